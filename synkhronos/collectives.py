"""Collectives on shared variables: the master's API.

Every collective validates its arguments here, before any worker is involved (ranks,
variables, ops, dtypes, ndims, static shapes), then sends one command that every rank
runs (``rankops``) through the comm plane.  What only the ranks can see together (unequal
shapes for a reduction) raises in every rank, leaving the variables as they were.

``avg`` is the mean over ranks; for integer and bool dtypes it is the float64 mean rounded
to nearest (half to even), dtype kept; float16 sums and averages accumulate in float32
(``synkhronos.reduce``).  ``gather`` returns exactly what each rank holds, in rank order:
stacked (``nd_up=1``) or concatenated (``nd_up=0``) when the shapes allow it, else a list
of per-rank arrays.  One variable gives one result, a list or tuple of variables a tuple.
``nccl=`` is accepted everywhere for compatibility: the comm plane picks the fastest path."""
import math

import numpy as np

from . import rankops, shards
from .data import Data, array_ref, condition, owner, resize
from .errors import OutOfRange
from .plans import ArrayRef, Rows, ScatterPlan, SetValuePlan, scatter_needs, set_value_needs
from .reductions import OPS, check_mode
from .session import get_session

# ---- validation ---------------------------------------------------------------------------


def _describe(v):
    shape = getattr(v, "shape", None)
    return f"{type(v).__name__}" + (f" of shape {tuple(shape)}" if shape is not None else "")


def _vars(session, shared_vars):
    """-> (list of registry ids, whether a single variable was given)."""
    single = not isinstance(shared_vars, (list, tuple))
    vs = [shared_vars] if single else list(shared_vars)
    if not vs:
        raise ValueError("no shared variables given")
    vids = []
    for v in vs:
        vid = session.shared_ids.get(id(v))
        if vid is None:
            if not hasattr(v, "container"):
                raise ValueError(f"expected a PyTensor shared variable, got a {_describe(v)}: not a shared "
                                 "variable of any distributed synkhronos function (collectives work on the "
                                 "shared variables of functions built with synk.function)")
            what = getattr(v, "name", None) or repr(v)
            raise ValueError(f"{what!s} is not a shared variable of any distributed synkhronos function: "
                             "collectives only know the shared variables used (as inputs, outputs or "
                             "update targets) by functions built with synk.function before "
                             "synk.distribute()")
        var = session.shareds[vid]
        if not (hasattr(var.type, "dtype") and hasattr(var.type, "ndim")):
            raise TypeError(f"collectives work on tensor shared variables; {var} has type {var.type}")
        vids.append(vid)
    if len(set(vids)) != len(vids):
        raise ValueError("the same shared variable was given more than once")
    return vids, single


def _values(session, vids, values, single, what):
    vals = [values] if single else values
    if not isinstance(vals, (list, tuple)) or len(vals) != len(vids):
        raise TypeError(f"{what}: give one value per shared variable ({len(vids)}), got {_describe(values)}")
    out = []
    for vid, v in zip(vids, vals):
        var = session.shareds[vid]
        if isinstance(v, Data):
            if owner(v) is not session:
                raise RuntimeError(f"{what}: the Data for {var} belongs to another (closed) "
                                   "synkhronos session")
            if v.dtype != var.type.dtype or v.ndim != var.ndim:
                raise TypeError(f"{what}: Data of dtype {v.dtype}, ndim {v.ndim} for {var} which has "
                                f"dtype {var.type.dtype}, ndim {var.ndim}")
            out.append(v)
        else:
            try:
                out.append(condition(v, var.type.dtype, var.ndim))
            except TypeError as e:
                raise TypeError(f"{what}: value for {var}: {e}") from None
    return out


def _check_rank(session, rank):
    if isinstance(rank, (bool, np.bool_)) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < session.n:
        raise ValueError(f"rank must be an int in [0, {session.n - 1}], got {rank!r}")
    return int(rank)


def _one_or_tuple(results, single):
    return results[0] if single else tuple(results)


# ---- staging: values the ranks read ---------------------------------------------------------


def _scratch(session, kind, i, dtype, shape):
    """A reusable buffer of ``shape`` for the ``i``-th value of ``kind``:
    ``(ArrayRef for the ranks, local array)``.  Backed by a flat Data, so 0-d values get a
    buffer too."""
    cache = session.scratch
    dtype = np.dtype(dtype)
    size = int(math.prod(shape))
    d = cache.get((kind, i))
    if d is None or d.dtype != dtype:
        d = cache[(kind, i)] = Data(dtype, 1, name=f"coll_{kind}", _session=session, _scratch=True)
    resize(d, (size,), 1.5 if size > d.alloc_size else 1, keep=False)
    return ArrayRef(array_ref(d).handle, dtype.str, tuple(shape)), d.data.reshape(shape)


def _staged(session, arrs, kind="stage"):
    """ArrayRefs for values: Data as they are, arrays copied into reusable staging."""
    refs = []
    for i, a in enumerate(arrs):
        if isinstance(a, Data) and a.ndim > 0:
            refs.append(array_ref(a))
            continue
        src = a.data if isinstance(a, Data) else a
        ref, arr = _scratch(session, kind, i, src.dtype, src.shape)
        np.copyto(arr, src)
        refs.append(ref)
    return refs


def _exec(session, op, vids, args=(), local_args=None, what=None, needs=()):
    """Run rank op ``op`` on every rank; returns ``(master's result, {rank: result})``."""
    me = session.me
    largs = args if local_args is None else local_args
    local = lambda: rankops.OPS[op](me, vids, *largs)  # noqa: E731
    return session.execute("coll", (op, vids, args), local, what=what or op, needs=needs)


def shapes_of(session, vids):
    """Every rank's shape of each variable: ``[[shape per rank] per variable]``."""
    mine, theirs = _exec(session, "shapes", vids, what="get_shapes")
    per_rank = dict(theirs)
    per_rank[session.rank] = mine
    return [[tuple(per_rank[r][i]) for r in range(session.n)] for i in range(len(vids))]


# ---- the collectives -----------------------------------------------------------------------


def broadcast(shared_vars, values=None, nccl=True):
    """Give every rank the master's value (or ``values``: arrays or Data, one per variable)
    of each shared variable."""
    session = get_session(True)
    with session.api(True):
        vids, single = _vars(session, shared_vars)
        vals = None
        if values is not None:
            vals = [v.data if isinstance(v, Data) else v for v in _values(session, vids, values, single, "broadcast")]
            for vid, v in zip(vids, vals):
                rankops.check_static(session.shareds[vid], v.shape, "broadcast")
        _exec(session, "broadcast", vids, (), (vals,))


def all_reduce(shared_vars, op="avg", nccl=True):
    """Every rank's variable becomes the reduction (avg, sum, prod, max, min) over ranks.
    All ranks must hold the same shape."""
    session = get_session(True)
    op = check_mode(op, OPS, "reduce op")
    with session.api(True):
        vids, _ = _vars(session, shared_vars)
        if session.n > 1:
            _exec(session, "all_reduce", vids, (op,))


def reduce(shared_vars, op="avg", in_place=True, nccl=True):
    """Reduce into the master; workers keep their values.  With ``in_place=False`` the
    master's variable is untouched and the result(s) are returned (one array, or a tuple
    for a list of variables)."""
    session = get_session(True)
    op = check_mode(op, OPS, "reduce op")
    with session.api(True):
        vids, single = _vars(session, shared_vars)
        mine, _ = _exec(session, "reduce", vids, (op, bool(in_place)))
        return None if in_place else _one_or_tuple([np.array(r, copy=True) for r in mine], single)


def gather(shared_vars, nd_up=1, nccl=True):
    """Every rank's value, in rank order: stacked on a new axis 0 (``nd_up=1``) or
    concatenated along axis 0 (``nd_up=0``).  Values whose shapes do not allow that (unequal
    shapes for ``nd_up=1``, unequal trailing shapes for ``nd_up=0``) come back exactly, as a
    list of per-rank arrays.  Variables are unchanged.  One array (or list) per variable; a
    tuple of them for a list of variables."""
    session = get_session(True)
    if isinstance(nd_up, bool) or nd_up not in (0, 1):
        raise ValueError(f"nd_up must be 0 or 1, got {nd_up!r}")
    with session.api(True):
        vids, single = _vars(session, shared_vars)
        if nd_up == 0:
            for vid in vids:
                if session.shareds[vid].ndim == 0:
                    raise ValueError(f"gather(nd_up=0) concatenates along axis 0, but {session.shareds[vid]} "
                                     "is 0-d; use nd_up=1")
        per_var, _ = _exec(session, "gather", vids)
        results = []
        for parts in per_var:
            if len({p.shape[1 - nd_up:] for p in parts}) > 1:        # exactly what each rank holds
                results.append(parts)
            else:
                results.append(np.stack(parts) if nd_up == 1 else np.concatenate(parts, axis=0))
        return _one_or_tuple(results, single)


def all_gather(shared_vars, nccl=True):
    """Every rank's variable becomes the concatenation (axis 0, rank order) of all ranks'."""
    session = get_session(True)
    with session.api(True):
        vids, _ = _vars(session, shared_vars)
        for vid in vids:
            if session.shareds[vid].ndim == 0:
                raise ValueError(f"all_gather of 0-d variable {session.shareds[vid]} is not possible "
                                 "(it concatenates along axis 0 and keeps ndim)")
        if session.n > 1:
            _exec(session, "all_gather", vids)


def scatter(shared_vars, values, batch=None):
    """Split each value (array or Data) along axis 0 over the ranks, as evenly as possible,
    in rank order; each value on its own (values may have different lengths).  ``batch``
    (an int, a slice or a list of indices) first selects rows of every value."""
    session = get_session(True)
    with session.api(True):
        vids, single = _vars(session, shared_vars)
        for vid in vids:
            if session.shareds[vid].ndim == 0:
                raise ValueError(f"scatter splits along axis 0, but {session.shareds[vid]} is 0-d")
        vals = _values(session, vids, values, single, "scatter")
        sel = shards.normalize_batch(batch)
        bounds = [_scatter_bounds(session, sel, len(v)) for v in vals]
        for vid, v, b in zip(vids, vals, bounds):
            for r in range(session.n):
                rankops.check_static(session.shareds[vid], (b[r + 1] - b[r],) + tuple(v.shape[1:]), "scatter")
        refs = _staged(session, vals)
        kind, base, index = "range", 0, None
        if sel is not None and sel[0] == "index":
            kind = "index"
            index, arr = _scratch(session, "index", 0, np.int64, sel[1].shape)
            np.copyto(arr, sel[1])
        elif sel is not None:
            base = sel[1]
        rows = tuple(Rows(kind, b, base, index) for b in bounds)
        plan = ScatterPlan(tuple(refs), rows)
        _exec(session, "scatter", vids, (plan,), needs=lambda: scatter_needs(plan))


def _scatter_bounds(session, sel, length):
    if sel is None:
        return shards.split(length, session.n)
    if sel[0] == "range":
        if sel[2] > length:
            raise OutOfRange(f"batch {sel[1]}:{sel[2]} is out of range for values of length {length}")
        return shards.split(sel[2] - sel[1], session.n, sel[1])
    idx = sel[1]
    if len(idx) and idx.max() >= length:
        raise OutOfRange(f"batch index {idx.max()} is out of range for values of length {length}")
    return shards.split(len(idx), session.n)


def set_value(rank, shared_vars, values, batch=None):
    """Set the value (array or Data; ``batch`` selects rows of it) of shared variable(s) in
    one rank, the master's included."""
    session = get_session(True)
    with session.api(True):
        rank = _check_rank(session, rank)
        vids, single = _vars(session, shared_vars)
        vals = _values(session, vids, values, single, "set_value")
        sel = shards.normalize_batch(batch)
        for vid, v in zip(vids, vals):
            shape = tuple(v.shape)
            if sel is not None:
                if len(shape) == 0:
                    raise ValueError("batch needs values with at least 1 dimension")
                top = shards.sel_max(sel)
                if top > shape[0]:
                    raise OutOfRange(f"batch selects row {top - 1} but the value has {shape[0]} rows")
                shape = (shards.sel_length(sel, shape[0]),) + shape[1:]
            rankops.check_static(session.shareds[vid], shape, "set_value")
        if rank == session.rank:
            dev = session.device
            for vid, v in zip(vids, vals):
                src = shards.select(v.data if isinstance(v, Data) else v, sel)
                dev.set(session.shareds[vid], dev.to_device(np.array(src, copy=True)))
            return
        refs = _staged(session, vals)
        if sel is not None and sel[0] == "index":
            ref, arr = _scratch(session, "index", 0, np.int64, sel[1].shape)
            np.copyto(arr, sel[1])
            sel = ("index", ref)
        plan = SetValuePlan(rank, tuple(refs), sel)
        _exec(session, "set_value", vids, (plan,), needs=lambda: set_value_needs(plan))


def get_value(rank, shared_vars):
    """Copy of the value(s) of shared variable(s) in one rank, the master's included."""
    session = get_session(True)
    with session.api(True):
        rank = _check_rank(session, rank)
        vids, single = _vars(session, shared_vars)
        if rank == session.rank:
            res = [np.array(rankops.value(session.me, session.shareds[v]), copy=True) for v in vids]
            return _one_or_tuple(res, single)
        _, theirs = _exec(session, "get_value", vids, (rank,))
        res = [np.array(a, copy=True) for a in theirs[rank]]
        return _one_or_tuple(res, single)


def get_shapes(shared_vars):
    """Shape of each variable on every rank: a list per variable (a tuple of lists for several)."""
    session = get_session(True)
    with session.api(True):
        vids, single = _vars(session, shared_vars)
        return _one_or_tuple(shapes_of(session, vids), single)


def get_lengths(shared_vars):
    """Length (axis 0) of each variable on every rank: a list per variable (a tuple of lists
    for several)."""
    session = get_session(True)
    with session.api(True):
        vids, single = _vars(session, shared_vars)
        for vid in vids:
            if session.shareds[vid].ndim == 0:
                raise ValueError(f"{session.shareds[vid]} is 0-d and has no length")
        res = [[s[0] for s in per] for per in shapes_of(session, vids)]
        return _one_or_tuple(res, single)
