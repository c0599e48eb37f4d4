"""Collectives on shared variables through shared memory (CPU backend).

Every rank keeps, for each shared variable it has taken part in a collective with, a
*slot*: a segment of its own that holds the variable's value, and the variable's storage
is re-pointed at that slot.  A collective then works on the slots directly:

* ``all_reduce``: rank r reduces chunk r of every rank's slot (reduce-scatter) and writes
  the result into chunk r of every slot (all-gather), in cache-sized blocks, so each rank
  reads and writes the buffer once in total, like one ``np.copyto`` split over the ranks;
* ``broadcast``: every worker copies the master's slot into its own, once;
* ``gather``/``reduce``: the master reads the workers' slots where they lie.

When a function update has replaced a variable's storage with a new array, the value is
first copied into the slot ("copy-in"); collectives always act on the live value.
``avg`` of integers is the float64 mean rounded to nearest (half to even), dtype kept."""
import numpy as np

from . import scatter as sc
from . import shm
from .commands import worker_command
from .data import Data, condition
from .reduce import REDUCE_OPS, check_mode, combine
from .runtime import get_runtime

MAXD = 16
_BLOCK_BYTES = 1 << 18
_BINARY = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


class Slots:
    """One rank's slots plus the table through which ranks publish their slots' shapes."""

    def __init__(self, prefix, rank, n, n_vars, create):
        self.prefix, self.rank, self.n = prefix, rank, n
        self.table_seg = shm.Segment(f"{prefix}_slots", max(1, n_vars) * n * (2 + MAXD) * 8, create=create)
        self.table = self.table_seg.array(np.int64, (max(1, n_vars), n, 2 + MAXD))
        self.own = {}     # vid -> (gen, Segment, address)
        self.peers = {}   # (vid, rank) -> (gen, Segment)

    def _own_slot(self, vid, nbytes):
        cur = self.own.get(vid)
        if cur is not None and cur[1].size >= nbytes:
            return cur
        gen = (cur[0] + 1) if cur else 1
        size = max(64, int(nbytes * (1.25 if cur else 1.0)))
        seg = shm.Segment(f"{self.prefix}_v{vid}_{self.rank}_{gen}", size, create=True)
        addr = np.frombuffer(seg.mm, np.uint8, count=1).ctypes.data
        if cur is not None:
            cur[1].unlink()
        self.own[vid] = entry = (gen, seg, addr)
        return entry

    def publish(self, vid, var, value=None):
        """Make this rank's slot hold ``value`` (default: the live value), point the variable's
        storage at it, and publish its shape.  Returns the slot view."""
        live = var.container.storage[0] if value is None else value
        live = np.asarray(live)
        if live.ndim > MAXD:
            raise ValueError(f"collectives support up to {MAXD} dimensions, got {live.ndim}")
        gen, seg, addr = self._own_slot(vid, live.nbytes)
        dtype = np.dtype(var.type.dtype)
        if not (value is None and live.dtype == dtype and live.flags.c_contiguous
                and live.__array_interface__["data"][0] == addr):
            view = seg.array(dtype, live.shape)
            np.copyto(view, live, casting="unsafe" if value is not None else "same_kind")
        else:
            view = live
        var.container.storage[0] = view
        row = self.table[vid, self.rank]
        row[2:2 + live.ndim] = live.shape
        row[1] = live.ndim
        row[0] = gen
        return view

    def resize(self, vid, var, shape):
        """Point the variable at a slot view of ``shape`` (contents undefined) and publish it."""
        dtype = np.dtype(var.type.dtype)
        gen, seg, _ = self._own_slot(vid, int(np.prod(shape)) * dtype.itemsize)
        view = seg.array(dtype, shape)
        var.container.storage[0] = view
        row = self.table[vid, self.rank]
        row[2:2 + len(shape)] = shape
        row[1] = len(shape)
        row[0] = gen
        return view

    def shape(self, vid, rank):
        row = self.table[vid, rank]
        return tuple(int(s) for s in row[2:2 + int(row[1])])

    def view(self, vid, rank, dtype):
        """The slot of ``rank`` for variable ``vid`` as published in the table."""
        if rank == self.rank:
            gen, seg, _ = self.own[vid]
        else:
            gen = int(self.table[vid, rank, 0])
            cur = self.peers.get((vid, rank))
            if cur is None or cur[0] != gen:
                cur = (gen, shm.Segment(f"{self.prefix}_v{vid}_{rank}_{gen}"))
                self.peers[(vid, rank)] = cur
            seg = cur[1]
        return seg.array(dtype, self.shape(vid, rank))


class Env:
    """What a collective needs from the rank it runs in (master or worker)."""

    def __init__(self, rank, n, master_rank, shareds, slots, barrier, view):
        self.rank, self.n, self.master_rank = rank, n, master_rank
        self.shareds, self.slots, self.barrier, self.view = shareds, slots, barrier, view
        self.is_master = rank == master_rank


def _chunks(size, n):
    return sc.split(size, n)


def _reduce_chunk(op, srcs, dsts, a, b, n, dtype):
    """Reduce elements [a, b) of the flat ``srcs`` into every flat ``dsts``, block by block."""
    if b <= a:
        return
    fn = _BINARY[op]
    wide = dtype
    if op == "avg":
        wide = np.dtype(np.float64) if dtype.kind in "biu" else (
            np.dtype(np.float32) if dtype == np.float16 else dtype)
    elif dtype == np.float16 and op == "sum":
        wide = np.dtype(np.float32)
    blk = max(1024, _BLOCK_BYTES // max(1, wide.itemsize))
    tmp = np.empty(min(blk, b - a), wide)
    scale = 1.0 / n
    for s in range(a, b, blk):
        e = min(b, s + blk)
        t = tmp[:e - s]
        if len(srcs) > 1 and wide == dtype:
            fn(srcs[0][s:e], srcs[1][s:e], out=t)
            rest = srcs[2:]
        else:
            np.copyto(t, srcs[0][s:e], casting="unsafe")
            rest = srcs[1:]
        for x in rest:
            fn(t, x[s:e], out=t, casting="unsafe")
        if op == "avg":
            t *= scale
            if dtype.kind in "biu":
                np.rint(t, out=t)
        for d in dsts:
            np.copyto(d[s:e], t, casting="unsafe")


# ---- the collectives, as run in every rank ------------------------------------------------

def _run(env, op, vids, args):
    return _OPS[op](env, vids, *args)


def _op_all_reduce(env, vids, op):
    for vid in vids:
        env.slots.publish(vid, env.shareds[vid])
    env.barrier()
    for vid in vids:
        var = env.shareds[vid]
        dtype = np.dtype(var.type.dtype)
        shapes = [env.slots.shape(vid, r) for r in range(env.n)]
        if len(set(shapes)) > 1:
            raise ValueError(f"all_reduce of {var} needs the same shape on every rank, got {shapes}")
        views = [env.slots.view(vid, r, dtype).reshape(-1) for r in range(env.n)]
        bounds = _chunks(views[0].size, env.n)
        _reduce_chunk(op, views, views, bounds[env.rank], bounds[env.rank + 1], env.n, dtype)
    env.barrier()


def _op_reduce(env, vids, op, dest_descs):
    for vid in vids:
        env.slots.publish(vid, env.shareds[vid])
    env.barrier()
    for vid, desc in zip(vids, dest_descs):
        var = env.shareds[vid]
        dtype = np.dtype(var.type.dtype)
        shapes = [env.slots.shape(vid, r) for r in range(env.n)]
        if len(set(shapes)) > 1:
            raise ValueError(f"reduce of {var} needs the same shape on every rank, got {shapes}")
        views = [env.slots.view(vid, r, dtype).reshape(-1) for r in range(env.n)]
        dest = views[env.master_rank] if desc is None else env.view(desc).reshape(-1)
        bounds = _chunks(views[0].size, env.n)
        _reduce_chunk(op, views, [dest], bounds[env.rank], bounds[env.rank + 1], env.n, dtype)
    env.barrier()


def _op_broadcast(env, vids):
    """Master's slots already hold the values (published before the command was sent)."""
    if env.is_master:
        return
    for vid in vids:
        var = env.shareds[vid]
        src = env.slots.view(vid, env.master_rank, np.dtype(var.type.dtype))
        env.slots.publish(vid, var, src)


def _op_publish(env, vids):
    """Workers copy their live values into their slots (for gather / get_value)."""
    if not env.is_master:
        for vid in vids:
            env.slots.publish(vid, env.shareds[vid])


def _op_all_gather(env, vids):
    for vid in vids:
        env.slots.publish(vid, env.shareds[vid])
    env.barrier()
    results = []
    for vid in vids:
        var = env.shareds[vid]
        dtype = np.dtype(var.type.dtype)
        parts = [env.slots.view(vid, r, dtype) for r in range(env.n)]
        if parts[0].ndim == 0 or len({p.shape[1:] for p in parts}) > 1:
            raise ValueError(f"all_gather of {var} concatenates along axis 0 and needs equal trailing "
                             f"shapes of at least 1 dimension; got {[p.shape for p in parts]}")
        results.append(np.concatenate(parts, axis=0))
    env.barrier()            # nobody reads slots any more: safe to overwrite
    for vid, res in zip(vids, results):
        env.slots.publish(vid, env.shareds[vid], res)


def _op_scatter(env, vids, descs, plan):
    kind, bounds, idx_desc = plan
    a, b = bounds[env.rank], bounds[env.rank + 1]
    idx = None if idx_desc is None else env.view(idx_desc)
    for vid, desc in zip(vids, descs):
        src = env.view(desc)
        part = src[a:b] if kind == "range" else np.take(src, idx[a:b], axis=0)
        env.slots.publish(vid, env.shareds[vid], part)


def _op_set_value(env, vids, rank, descs, sel):
    if env.rank != rank:
        return
    for vid, desc in zip(vids, descs):
        src = env.view(desc)
        if sel is not None:
            src = src[sel[1]:sel[2]] if sel[0] == "range" else np.take(src, sel[1], axis=0)
        env.slots.publish(vid, env.shareds[vid], src)


def _op_shapes(env, vids):
    return [np.shape(env.shareds[vid].container.storage[0]) for vid in vids]


_OPS = {"all_reduce": _op_all_reduce, "reduce": _op_reduce, "broadcast": _op_broadcast,
        "publish": _op_publish, "all_gather": _op_all_gather, "scatter": _op_scatter,
        "set_value": _op_set_value, "shapes": _op_shapes}


@worker_command("coll")
def _w_coll(ctx, op, vids, args):
    return _run(ctx.coll_env, op, vids, args)


def worker_env(ctx):
    return Env(ctx.rank, ctx.n, ctx.master_rank, ctx.shareds,
               Slots(ctx.prefix, ctx.rank, ctx.n, len(ctx.shareds), create=False),
               ctx.barrier, ctx.view)


def master_env(rt):
    if getattr(rt, "coll_env", None) is None:
        rt.coll_env = Env(rt.rank, rt.n, rt.master_rank, rt.shareds,
                          Slots(rt.prefix, rt.rank, rt.n, len(rt.shareds), create=True),
                          lambda: rt.transport.barrier(rt.alive_check), _master_view)
    return rt.coll_env


def _master_view(desc):
    raise AssertionError("master reads its own Data directly")


# ---- master-side API ----------------------------------------------------------------------

def _vars(rt, shared_vars):
    """-> (list of registry ids, whether a single variable was given)."""
    single = not isinstance(shared_vars, (list, tuple))
    vs = [shared_vars] if single else list(shared_vars)
    if not vs:
        raise ValueError("no shared variables given")
    vids = []
    for v in vs:
        vid = rt.shared_ids.get(id(v))
        if vid is None:
            raise ValueError(f"{v!r} is not a shared variable of any distributed synkhronos function; "
                             "collectives only know variables used by functions built before distribute()")
        vids.append(vid)
    if len(set(vids)) != len(vids):
        raise ValueError("the same shared variable was given more than once")
    return vids, single


def _values(rt, vids, values, single, what):
    vals = [values] if single else values
    if not isinstance(vals, (list, tuple)) or len(vals) != len(vids):
        raise TypeError(f"{what}: give one value per shared variable ({len(vids)}), got {values!r}"[:300])
    out = []
    for vid, v in zip(vids, vals):
        var = rt.shareds[vid]
        if isinstance(v, Data):
            if v.dtype != var.type.dtype or v.ndim != var.ndim:
                raise TypeError(f"{what}: Data of dtype {v.dtype}, ndim {v.ndim} for {var} which has "
                                f"dtype {var.type.dtype}, ndim {var.ndim}")
            out.append(v)
        else:
            out.append(condition(v, var.type.dtype, var.ndim))
    return out


def _staged(rt, arrs):
    """Data descriptors for values: Data as they are, arrays copied into reusable staging."""
    stage = getattr(rt, "coll_stage", None)
    if stage is None:
        stage = rt.coll_stage = []
    descs, locals_ = [], []
    for i, a in enumerate(arrs):
        if isinstance(a, Data):
            descs.append(a._desc())
            locals_.append(a.data)
            continue
        while len(stage) <= i:
            stage.append(Data(a.dtype, a.ndim, name="coll_stage", _rt=rt))
        d = stage[i]
        if d.dtype != a.dtype or d.ndim != a.ndim:
            d = stage[i] = Data(a.dtype, a.ndim, name="coll_stage", _rt=rt)
        d._reshape(a.shape, 1.5 if a.size > d.alloc_size else 1, keep=False)
        np.copyto(d.data, a)
        descs.append(d._desc())
        locals_.append(d.data)
    return descs, locals_


def _exec(rt, op, vids, args, local=None, what=None):
    env = master_env(rt)
    if local is None:
        local = lambda: _run(env, op, vids, args)  # noqa: E731
    return rt.execute("coll", (op, vids, args), local, what=what or op)


def _one_or_tuple(results, single):
    return results[0] if single else tuple(results)


def broadcast(shared_vars, values=None, nccl=True):
    """Give every rank the master's value (or ``values``) of each shared variable."""
    rt = get_runtime(True)
    vids, single = _vars(rt, shared_vars)
    vals = None if values is None else _values(rt, vids, values, single, "broadcast")
    env = master_env(rt)
    for i, vid in enumerate(vids):
        var = rt.shareds[vid]
        if vals is None:
            env.slots.publish(vid, var)
        else:
            v = vals[i].data if isinstance(vals[i], Data) else vals[i]
            env.slots.publish(vid, var, v)
    _exec(rt, "broadcast", vids, (), local=lambda: None)


def all_reduce(shared_vars, op="avg", nccl=True):
    """Every rank's variable becomes the reduction (avg, sum, prod, max, min) over ranks."""
    rt = get_runtime(True)
    op = check_mode(op, REDUCE_OPS, "reduce op")
    vids, _ = _vars(rt, shared_vars)
    _exec(rt, "all_reduce", vids, (op,))


def reduce(shared_vars, op="avg", in_place=True, nccl=True):
    """Reduce into the master; workers keep their values.  With ``in_place=False`` the
    master's variable is untouched and the result(s) are returned."""
    rt = get_runtime(True)
    op = check_mode(op, REDUCE_OPS, "reduce op")
    vids, single = _vars(rt, shared_vars)
    dests, descs = [], []
    if not in_place:
        for vid in vids:
            var = rt.shareds[vid]
            shape = np.shape(var.container.storage[0])
            d = Data(var.type.dtype, var.ndim, name="reduce_result", _rt=rt)
            d.set_shape(shape)
            dests.append(d)
            descs.append(d._desc())
    else:
        descs = [None] * len(vids)
    env = master_env(rt)

    def local():
        env.view = lambda desc: _by_desc(dests, desc)
        return _run(env, "reduce", vids, (op, descs))
    _exec(rt, "reduce", vids, (op, descs), local=local)
    if in_place:
        return None
    results = [np.array(d.data, copy=True) for d in dests]
    for d in dests:
        d.free_memory()
    return _one_or_tuple(results, single) if len(results) > 1 or single else results[0]


def _by_desc(datas, desc):
    for d in datas:
        if d._desc() == desc:
            return d.data
    raise KeyError(desc)


def gather(shared_vars, nd_up=1, nccl=True):
    """Every rank's value, in rank order: stacked on a new axis (``nd_up=1``) or concatenated
    along axis 0 (``nd_up=0``).  Values of different shapes come back exactly: with
    ``nd_up=1`` as a list of per-rank arrays.  Variables are unchanged."""
    rt = get_runtime(True)
    if nd_up not in (0, 1):
        raise ValueError(f"nd_up must be 0 or 1, got {nd_up!r}")
    vids, single = _vars(rt, shared_vars)
    env = master_env(rt)
    _exec(rt, "publish", vids, (), local=lambda: None)
    results = []
    for vid in vids:
        var = rt.shareds[vid]
        dtype = np.dtype(var.type.dtype)
        parts = [np.asarray(var.container.storage[0]) if r == rt.rank else env.slots.view(vid, r, dtype)
                 for r in range(rt.n)]
        if nd_up == 1:
            if len({p.shape for p in parts}) == 1:
                results.append(np.stack(parts))
            else:
                results.append([np.array(p, copy=True) for p in parts])
        else:
            if parts[0].ndim == 0 or len({p.shape[1:] for p in parts}) > 1:
                raise ValueError(f"gather(nd_up=0) of {var} concatenates along axis 0 and needs equal "
                                 f"trailing shapes of at least 1 dimension; got {[p.shape for p in parts]}")
            results.append(np.concatenate(parts, axis=0))
    return _one_or_tuple(results, single)


def all_gather(shared_vars, nccl=True):
    """Every rank's variable becomes the concatenation (axis 0, rank order) of all ranks'."""
    rt = get_runtime(True)
    vids, _ = _vars(rt, shared_vars)
    for vid in vids:
        if rt.shareds[vid].ndim == 0:
            raise ValueError(f"all_gather of 0-d variable {rt.shareds[vid]} is not possible (ndim is kept)")
    _exec(rt, "all_gather", vids, ())


def scatter(shared_vars, values, batch=None):
    """Split each value along axis 0 (after selecting ``batch`` rows) over the ranks."""
    rt = get_runtime(True)
    vids, single = _vars(rt, shared_vars)
    vals = _values(rt, vids, values, single, "scatter")
    for vid, v in zip(vids, vals):
        if np.ndim(v) == 0:
            raise ValueError(f"scatter needs values with at least 1 dimension for {rt.shareds[vid]}")
    lens = {len(v) for v in vals}
    if len(lens) > 1:
        raise ValueError(f"scatter values have different lengths {sorted(lens)}")
    length = lens.pop()
    sel = sc.normalize_batch(batch)
    descs, arrays = _staged(rt, vals)
    idx_desc, idx_arr = None, None
    if sel is None:
        kind, bounds = "range", sc.split(length, rt.n)
    elif sel[0] == "range":
        if sel[2] > length:
            raise IndexError(f"batch {sel[1]}:{sel[2]} is out of range for values of length {length}")
        kind, bounds = "range", sc.split(sel[2] - sel[1], rt.n, sel[1])
    else:
        idx = sel[1]
        if len(idx) and idx.max() >= length:
            raise IndexError(f"batch index {idx.max()} is out of range for values of length {length}")
        kind, bounds = "index", sc.split(len(idx), rt.n)
        (idx_desc,), (idx_arr,) = _staged_extra(rt, idx)
    env = master_env(rt)

    def local():
        env.view = lambda desc: idx_arr if desc == idx_desc else arrays[descs.index(desc)]
        return _run(env, "scatter", vids, (descs, (kind, bounds, idx_desc)))
    _exec(rt, "scatter", vids, (descs, (kind, bounds, idx_desc)), local=local)


def _staged_extra(rt, arr):
    d = getattr(rt, "coll_idx", None)
    if d is None:
        d = rt.coll_idx = Data(np.int64, 1, name="coll_idx", _rt=rt)
    d._reshape(arr.shape, 1.5 if arr.size > d.alloc_size else 1, keep=False)
    np.copyto(d.data, arr)
    return [d._desc()], [d.data]


def _check_rank(rt, rank):
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < rt.n:
        raise ValueError(f"rank must be an int in [0, {rt.n - 1}], got {rank!r}")
    return int(rank)


def set_value(rank, shared_vars, values, batch=None):
    """Set the value of shared variable(s) in one rank (the master's included)."""
    rt = get_runtime(True)
    rank = _check_rank(rt, rank)
    vids, single = _vars(rt, shared_vars)
    vals = _values(rt, vids, values, single, "set_value")
    sel = sc.normalize_batch(batch)
    if sel is not None:
        for vid, v in zip(vids, vals):
            if np.ndim(v) == 0:
                raise ValueError("batch needs values with at least 1 dimension")
            top = sc.sel_max(sel)
            if top > len(v):
                raise IndexError(f"batch selects row {top - 1} but the value has {len(v)} rows")
    if rank == rt.rank:
        env = master_env(rt)
        for vid, v in zip(vids, vals):
            src = v.data if isinstance(v, Data) else v
            if sel is not None:
                src = src[sel[1]:sel[2]] if sel[0] == "range" else np.take(src, sel[1], axis=0)
            env.slots.publish(vid, rt.shareds[vid], src)
        return
    descs, _ = _staged(rt, vals)
    _exec(rt, "set_value", vids, (rank, descs, sel), local=lambda: None)


def get_value(rank, shared_vars):
    """Copy of the value(s) of shared variable(s) in one rank."""
    rt = get_runtime(True)
    rank = _check_rank(rt, rank)
    vids, single = _vars(rt, shared_vars)
    if rank == rt.rank:
        res = [np.array(rt.shareds[v].container.storage[0], copy=True) for v in vids]
        return _one_or_tuple(res, single)
    _exec(rt, "publish", vids, (), local=lambda: None)
    env = master_env(rt)
    res = [np.array(env.slots.view(v, rank, np.dtype(rt.shareds[v].type.dtype)), copy=True) for v in vids]
    return _one_or_tuple(res, single)


def get_shapes(shared_vars):
    """Shape of each variable on every rank: a list per variable (a tuple of lists for several)."""
    rt = get_runtime(True)
    vids, single = _vars(rt, shared_vars)
    mine, theirs = _exec(rt, "shapes", vids, ())
    per_rank = dict(theirs)
    per_rank[rt.rank] = mine
    res = [[tuple(per_rank[r][i]) for r in range(rt.n)] for i in range(len(vids))]
    return _one_or_tuple(res, single)


def get_lengths(shared_vars):
    """Length (axis 0) of each variable on every rank."""
    rt = get_runtime(True)
    vids, single = _vars(rt, shared_vars)
    for vid in vids:
        if rt.shareds[vid].ndim == 0:
            raise ValueError(f"{rt.shareds[vid]} is 0-d and has no length")
    shapes = get_shapes([rt.shareds[v] for v in vids])
    res = [[s[0] for s in per] for per in shapes]
    return _one_or_tuple(res, single)
