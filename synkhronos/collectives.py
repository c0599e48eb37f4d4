"""Collectives on shared variables through shared memory (CPU backend).

Every rank keeps, for each shared variable it has taken part in a collective with, a
*slot*: a segment of its own that can hold the variable's value, and after a collective
that leaves the whole value there the variable's storage is re-pointed at that slot.  A
collective then works on the slots directly:

* ``all_reduce``: rank r reduces chunk r of every rank's value (reduce-scatter) and writes
  the result into chunk r of every slot (all-gather), block by block while the block is in
  cache, so each rank reads and writes the buffer about once in total, like one
  ``np.copyto`` split over the ranks;
* ``reduce``: the same, writing only into the master's slot (or a result buffer);
* ``broadcast``: every worker copies the master's slot into its own (large values: every
  rank copies one chunk into every worker's slot);
* ``gather``/``get_value``: the master reads the workers' slots where they lie.

When a function update has replaced a variable's storage with a new array, the value is
first copied into the slot ("copy-in"): for ``all_reduce``/``reduce`` only the chunks that
other ranks read, the rank's own chunk is read from the live array.  Collectives always act
on the live value.  ``avg`` is the sum times 1/n; for integer and bool dtypes it is the
float64 mean rounded to nearest (half to even), dtype kept; float16 sums and averages
accumulate in float32.

``gather`` returns exactly what each rank holds, in rank order: stacked (``nd_up=1``) or
concatenated (``nd_up=0``) when the shapes allow it, else a list of per-rank arrays.

Results: one variable gives one result, a list or tuple of variables gives a tuple.
``nccl=`` is accepted everywhere for compatibility; the CPU backend has no faster path.
Everything the master can check (ranks, variables, ops, dtypes, ndims, static shapes) is
checked before any worker is involved; what only the ranks can see together (unequal shapes
for a reduction) raises in every rank, leaving the variables as they were."""
import numpy as np

from . import scatter as sc
from . import shm
from .commands import worker_command
from .data import Data, condition
from .reduce import REDUCE_OPS, check_mode
from .runtime import get_runtime

MAXD = 16
_TMP_BLOCK_BYTES = 1 << 18       # widened (float32/float64) accumulation blocks
_BLOCK_BYTES = 1 << 17           # in-place reduction blocks (per source), cache-resident
_SPLIT_BCAST_BYTES = 1 << 20     # broadcast of at least this much: every rank copies a chunk
_ALIGN = 64                      # chunk boundaries on cache lines
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

    def _announce(self, vid, gen, shape):
        row = self.table[vid, self.rank]
        row[2:2 + len(shape)] = shape
        row[1] = len(shape)
        row[0] = gen

    def holds(self, vid, arr, dtype):
        """Whether ``arr`` is exactly this rank's slot of ``vid`` (no copy-in needed)."""
        cur = self.own.get(vid)
        return (cur is not None and arr.dtype == dtype and arr.flags.c_contiguous
                and arr.__array_interface__["data"][0] == cur[2] and arr.nbytes <= cur[1].size)

    def ensure(self, vid, dtype, shape):
        """This rank's slot of ``vid`` as an array of ``shape`` (contents kept only if the
        allocation is reused), published in the table."""
        shape = tuple(int(s) for s in shape)
        if len(shape) > MAXD:
            raise ValueError(f"collectives support up to {MAXD} dimensions, got {len(shape)}")
        gen, seg, _ = self._own_slot(vid, int(np.prod(shape)) * dtype.itemsize)
        self._announce(vid, gen, shape)
        return seg.array(dtype, shape)

    def publish(self, vid, var, value=None):
        """Make this rank's slot hold ``value`` (default: the live value), point the variable's
        storage at it, and publish its shape.  Returns the slot view."""
        dtype = np.dtype(var.type.dtype)
        live = np.asarray(var.container.storage[0] if value is None else value)
        if value is None and self.holds(vid, live, dtype):
            self._announce(vid, self.own[vid][0], live.shape)
            return live
        cur = self.own.get(vid)
        if cur is not None and _overlaps(live, cur[1]):
            live = np.array(live, copy=True)          # a view of the slot itself
        view = self.ensure(vid, dtype, live.shape)
        np.copyto(view, live, casting="unsafe" if value is not None else "same_kind")
        var.container.storage[0] = view
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


def _overlaps(arr, seg):
    if arr.size == 0:
        return False
    base = np.frombuffer(seg.mm, np.uint8)
    return np.may_share_memory(arr, base)


class Env:
    """What a collective needs from the rank it runs in (master or worker)."""

    def __init__(self, rank, n, master_rank, shareds, slots, barrier, view):
        self.rank, self.n, self.master_rank = rank, n, master_rank
        self.shareds, self.slots, self.barrier, self.view = shareds, slots, barrier, view
        self.is_master = rank == master_rank


def _chunks(size, n, itemsize):
    """Chunk boundaries of ``size`` items over ``n`` ranks, on cache-line multiples."""
    q = max(1, _ALIGN // max(1, itemsize))
    nq = -(-size // q)
    b = [min(size, (r * nq // n) * q) for r in range(n + 1)]
    b[-1] = size
    return b


def _wide(op, dtype):
    """The accumulation dtype when it differs from ``dtype`` (else None)."""
    if op == "avg" and dtype.kind in "biu":
        return np.dtype(np.float64)
    if dtype == np.float16 and op in ("sum", "avg"):
        return np.dtype(np.float32)
    return None


def _addr(a):
    return a.__array_interface__["data"][0]


def _reduce_chunk(op, srcs, dsts, a, b, n, dtype):
    """Reduce elements [a, b) of the flat ``srcs`` (rank order) into every flat ``dsts``.

    Exact-dtype ops accumulate straight into the first destination (when that is safe:
    it is srcs[0], srcs[1] or no source at all) and copy the block to the others while it is
    in cache; widened ops go through a small temporary block."""
    if b <= a:
        return
    if len(srcs) == 1:                       # one rank: the value itself
        for d in dsts:
            if _addr(d) != _addr(srcs[0]):
                np.copyto(d[a:b], srcs[0][a:b])
        return
    fn = _BINARY[op]
    scale = 1.0 / n
    wide = _wide(op, dtype)
    d0 = None
    if wide is None:
        late = {_addr(s) for s in srcs[2:]}
        for i, d in enumerate(dsts):
            if _addr(d) not in late:
                d0 = d
                others = dsts[:i] + dsts[i + 1:]
                break
    if d0 is not None:
        blk = max(4096, _BLOCK_BYTES // dtype.itemsize)
        s0, s1, rest = srcs[0], srcs[1], srcs[2:]
        for s in range(a, b, blk):
            e = min(b, s + blk)
            t = d0[s:e]
            fn(s0[s:e], s1[s:e], out=t)
            for x in rest:
                fn(t, x[s:e], out=t)
            if op == "avg":
                t *= scale
            for o in others:
                np.copyto(o[s:e], t)
        return
    wide = wide or dtype
    blk = max(1024, _TMP_BLOCK_BYTES // wide.itemsize)
    tmp = np.empty(min(blk, b - a), wide)
    for s in range(a, b, blk):
        e = min(b, s + blk)
        t = tmp[:e - s]
        if wide == dtype:
            fn(srcs[0][s:e], srcs[1][s:e], out=t)
            rest = srcs[2:]
        else:
            np.copyto(t, srcs[0][s:e], casting="unsafe")
            rest = srcs[1:]
        for x in rest:
            fn(t, x[s:e], out=t, casting="unsafe")
        if op == "avg":
            if dtype.kind in "biu":          # the float64 mean, rounded half to even
                np.divide(t, n, out=t)
                np.rint(t, out=t)
            else:
                t *= scale
        for d in dsts:
            np.copyto(d[s:e], t, casting="unsafe")


# ---- the collectives, as run in every rank ------------------------------------------------

def _run(env, op, vids, args):
    return _OPS[op](env, vids, *args)


def _live(var, dtype):
    """The variable's live value as an array of its dtype."""
    live = np.asarray(var.container.storage[0])
    if live.dtype != dtype:
        tmp = np.empty(live.shape, dtype)
        np.copyto(tmp, live, casting="same_kind")
        live = tmp
    if live.ndim > MAXD:
        raise ValueError(f"collectives support up to {MAXD} dimensions, got {live.ndim}")
    return live


def _stage_for_reduce(env, vid):
    """Copy-in for a reduction: returns ``(own flat source, whether it is the slot)``.

    If the live value is not the slot, every chunk but this rank's own is copied into the
    slot (the others read those); this rank reads its own chunk from the live array."""
    var = env.shareds[vid]
    dtype = np.dtype(var.type.dtype)
    slots = env.slots
    raw = np.asarray(var.container.storage[0])
    if slots.holds(vid, raw, dtype):
        slots._announce(vid, slots.own[vid][0], raw.shape)
        return raw.reshape(-1), True
    live = _live(var, dtype)
    cur = slots.own.get(vid)
    if cur is not None and _overlaps(live, cur[1]):
        live = np.array(live, copy=True)
    view = slots.ensure(vid, dtype, live.shape).reshape(-1)
    flat = np.ascontiguousarray(live).reshape(-1)
    bounds = _chunks(flat.size, env.n, dtype.itemsize)
    a, b = bounds[env.rank], bounds[env.rank + 1]
    if a > 0:
        np.copyto(view[:a], flat[:a])
    if b < flat.size:
        np.copyto(view[b:], flat[b:])
    return flat, False


def _open_all(env, vids):
    """Flat views of every rank's slot of each variable (attaching peers' segments)."""
    return [[env.slots.view(vid, r, np.dtype(env.shareds[vid].type.dtype)).reshape(-1)
             for r in range(env.n)] for vid in vids]


def _prepare_reduction(env, vids, what):
    """Phase 1 of all_reduce/reduce: stage the live values, meet, check shapes (every rank
    raises alike), attach every rank's slots (may fail: the caller's next barrier makes sure
    nobody writes unless every rank got this far)."""
    own = [_stage_for_reduce(env, vid) for vid in vids]
    env.barrier(check_after=False)
    _check_equal_shapes(env, vids, what)
    return own, _open_all(env, vids)


def _sources(env, views, src, in_slot):
    """The arrays to reduce: every rank's slot, this rank's own live value if not staged."""
    srcs = list(views)
    if not in_slot:
        srcs[env.rank] = src
    return srcs


def _check_equal_shapes(env, vids, what):
    for vid in vids:
        shapes = [env.slots.shape(vid, r) for r in range(env.n)]
        if len(set(shapes)) > 1:
            raise ValueError(f"{what} of {env.shareds[vid]} needs the same shape on every rank, "
                             f"got {shapes} (by rank)")


def _op_all_reduce(env, vids, op):
    if env.n == 1:
        return
    own, all_views = _prepare_reduction(env, vids, "all_reduce")
    env.barrier()                                    # all opened: now everyone writes
    for vid, (src, in_slot), views in zip(vids, own, all_views):
        var = env.shareds[vid]
        dtype = np.dtype(var.type.dtype)
        srcs = _sources(env, views, src, in_slot)
        bounds = _chunks(src.size, env.n, dtype.itemsize)
        _reduce_chunk(op, srcs, views, bounds[env.rank], bounds[env.rank + 1], env.n, dtype)
        var.container.storage[0] = views[env.rank].reshape(env.slots.shape(vid, env.rank))
    # no closing barrier: ranks write only the other slots' chunks of their own, and the
    # master returns only once every worker has replied


def _op_reduce(env, vids, op, dest_descs):
    if env.n == 1:
        for vid, desc in zip(vids, dest_descs):
            var = env.shareds[vid]
            if desc is not None:
                np.copyto(env.view(desc), _live(var, np.dtype(var.type.dtype)), casting="unsafe")
        return
    own, all_views = _prepare_reduction(env, vids, "reduce")
    dests = [views[env.master_rank] if desc is None else env.view(desc).reshape(-1)
             for views, desc in zip(all_views, dest_descs)]
    env.barrier()                                    # all opened: now everyone writes
    for vid, desc, (src, in_slot), views, dest in zip(vids, dest_descs, own, all_views, dests):
        var = env.shareds[vid]
        dtype = np.dtype(var.type.dtype)
        srcs = _sources(env, views, src, in_slot)
        bounds = _chunks(src.size, env.n, dtype.itemsize)
        _reduce_chunk(op, srcs, [dest], bounds[env.rank], bounds[env.rank + 1], env.n, dtype)
        if desc is None and env.is_master:
            var.container.storage[0] = views[env.rank].reshape(env.slots.shape(vid, env.rank))


def _op_broadcast(env, vids, split):
    """Master's slots already hold the values (published before the command was sent).

    Small values: every worker copies the master's slot into its own.  Large values
    (``split``): workers size their slots, then every rank copies chunk ``rank`` of the
    master's slot into every worker's slot."""
    if not split:
        if env.is_master:
            return
        for vid in vids:
            var = env.shareds[vid]
            src = env.slots.view(vid, env.master_rank, np.dtype(var.type.dtype))
            env.slots.publish(vid, var, src)
        return
    targets = []
    if not env.is_master:     # size the slots now; point the variables at them once written
        for vid in vids:
            var = env.shareds[vid]
            dtype = np.dtype(var.type.dtype)
            targets.append((var, env.slots.ensure(vid, dtype, env.slots.shape(vid, env.master_rank))))
    env.barrier()
    all_views = _open_all(env, vids)
    env.barrier()                                    # all opened: now everyone writes
    for vid, views in zip(vids, all_views):
        dtype = np.dtype(env.shareds[vid].type.dtype)
        src = views[env.master_rank]
        bounds = _chunks(src.size, env.n, dtype.itemsize)
        a, b = bounds[env.rank], bounds[env.rank + 1]
        if b <= a:
            continue
        for r in range(env.n):
            if r != env.master_rank:
                np.copyto(views[r][a:b], src[a:b])
    for var, view in targets:
        var.container.storage[0] = view


def _op_publish(env, vids, rank=None):
    """Workers copy their live values into their slots (for gather / get_value)."""
    if not env.is_master and (rank is None or rank == env.rank):
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
                             f"shapes of at least 1 dimension; got {[p.shape for p in parts]} (by rank)")
        total = (sum(len(p) for p in parts),) + parts[0].shape[1:]
        _check_static(var, total, "all_gather")
        results.append(parts)
    out = [np.concatenate(parts, axis=0) for parts in results]
    env.barrier()            # nobody reads slots any more: safe to overwrite
    for vid, res in zip(vids, out):
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
                          lambda check_after=True: rt.transport.barrier(rt.alive_check, check_after), _master_view)
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
            what = getattr(v, "name", None) or repr(v)
            raise ValueError(f"{what!s} is not a shared variable of any distributed synkhronos function: "
                             "collectives only know the shared variables used (as inputs, outputs or "
                             "update targets) by functions built with synk.function before "
                             "synk.distribute()")
        var = rt.shareds[vid]
        if not (hasattr(var.type, "dtype") and hasattr(var.type, "ndim")):
            raise TypeError(f"collectives work on tensor shared variables; {var} has type {var.type}")
        vids.append(vid)
    if len(set(vids)) != len(vids):
        raise ValueError("the same shared variable was given more than once")
    return vids, single


def _check_static(var, shape, what):
    static = getattr(var.type, "shape", None)
    if static is None:
        return
    for ax, s in enumerate(static):
        if s is not None and shape[ax] != s:
            raise ValueError(f"{what}: {var} has static shape {static}, which a value of shape "
                             f"{tuple(shape)} does not fit")


def _values(rt, vids, values, single, what):
    vals = [values] if single else values
    if not isinstance(vals, (list, tuple)) or len(vals) != len(vids):
        raise TypeError(f"{what}: give one value per shared variable ({len(vids)}), got {values!r}"[:300])
    out = []
    for vid, v in zip(vids, vals):
        var = rt.shareds[vid]
        if isinstance(v, Data):
            if v._rt_ref() is not rt:
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


def _scratch(rt, kind, i, dtype, shape):
    """A reusable shared-memory buffer of ``shape`` for the ``i``-th value of ``kind``:
    ``(descriptor for the workers, local array)``.  Backed by a flat Data, so 0-d values get
    shared memory too."""
    cache = getattr(rt, "coll_scratch", None)
    if cache is None:
        cache = rt.coll_scratch = {}
    dtype = np.dtype(dtype)
    size = int(np.prod(shape))
    d = cache.get((kind, i))
    if d is None or d.dtype != dtype:
        d = cache[(kind, i)] = Data(dtype, 1, name=f"coll_{kind}", _rt=rt)
    d._reshape((size,), 1.5 if size > d.alloc_size else 1, keep=False)
    name = d._desc()[0]
    return (name, dtype.str, tuple(shape)), d.data.reshape(shape)


def _staged(rt, arrs):
    """Data descriptors for values: Data as they are, arrays copied into reusable staging."""
    descs, locals_ = [], []
    for i, a in enumerate(arrs):
        if isinstance(a, Data) and a.ndim > 0:
            descs.append(a._desc())
            locals_.append(a.data)
            continue
        src = a.data if isinstance(a, Data) else a
        desc, arr = _scratch(rt, "stage", i, src.dtype, src.shape)
        np.copyto(arr, src)
        descs.append(desc)
        locals_.append(arr)
    return descs, locals_


def _exec(rt, op, vids, args, local=None, what=None):
    env = master_env(rt)
    if local is None:
        local = lambda: _run(env, op, vids, args)  # noqa: E731
    return rt.execute("coll", (op, vids, args), local, what=what or op)


def _one_or_tuple(results, single):
    return results[0] if single else tuple(results)


def _dtype(rt, vid):
    return np.dtype(rt.shareds[vid].type.dtype)


def broadcast(shared_vars, values=None, nccl=True):
    """Give every rank the master's value (or ``values``: arrays or Data, one per variable)
    of each shared variable.  ``nccl`` is accepted for compatibility (no GPU fast path here)."""
    rt = get_runtime(True)
    with rt.lock:
        vids, single = _vars(rt, shared_vars)
        vals = None if values is None else _values(rt, vids, values, single, "broadcast")
        if vals is not None:
            for vid, v in zip(vids, vals):
                _check_static(rt.shareds[vid], v.shape, "broadcast")
        env = master_env(rt)
        total = 0
        for i, vid in enumerate(vids):
            var = rt.shareds[vid]
            if vals is None:
                view = env.slots.publish(vid, var)
            else:
                v = vals[i].data if isinstance(vals[i], Data) else vals[i]
                view = env.slots.publish(vid, var, v)
            total += view.nbytes
        if rt.n == 1:
            return
        split = total >= _SPLIT_BCAST_BYTES
        args = (split,)
        _exec(rt, "broadcast", vids, args, local=(lambda: _run(env, "broadcast", vids, args)) if split
              else (lambda: None))


def all_reduce(shared_vars, op="avg", nccl=True):
    """Every rank's variable becomes the reduction (avg, sum, prod, max, min) over ranks.
    All ranks must hold the same shape."""
    rt = get_runtime(True)
    op = check_mode(op, REDUCE_OPS, "reduce op")
    with rt.lock:
        vids, _ = _vars(rt, shared_vars)
        if rt.n == 1:
            return
        _exec(rt, "all_reduce", vids, (op,))


def reduce(shared_vars, op="avg", in_place=True, nccl=True):
    """Reduce into the master; workers keep their values.  With ``in_place=False`` the
    master's variable is untouched and the result(s) are returned (one array, or a tuple
    for a list of variables)."""
    rt = get_runtime(True)
    op = check_mode(op, REDUCE_OPS, "reduce op")
    with rt.lock:
        vids, single = _vars(rt, shared_vars)
        env = master_env(rt)
        if in_place:
            if rt.n > 1:
                _exec(rt, "reduce", vids, (op, [None] * len(vids)))
            return None
        dests, descs = [], []
        for i, vid in enumerate(vids):
            shape = np.shape(rt.shareds[vid].container.storage[0])
            desc, arr = _scratch(rt, "result", i, _dtype(rt, vid), shape)
            dests.append(arr)
            descs.append(desc)

        def local():
            env.view = lambda desc: dests[descs.index(desc)]
            return _run(env, "reduce", vids, (op, descs))
        if rt.n == 1:
            local()
        else:
            _exec(rt, "reduce", vids, (op, descs), local=local)
        results = [np.array(d, copy=True) for d in dests]
        return _one_or_tuple(results, single)


def gather(shared_vars, nd_up=1, nccl=True):
    """Every rank's value, in rank order: stacked on a new axis 0 (``nd_up=1``) or
    concatenated along axis 0 (``nd_up=0``).  Values whose shapes do not allow that (unequal
    shapes for ``nd_up=1``, unequal trailing shapes for ``nd_up=0``) come back exactly, as a
    list of per-rank arrays.  Variables are unchanged.  One array (or list) per variable; a
    tuple of them for a list of variables."""
    rt = get_runtime(True)
    if isinstance(nd_up, bool) or nd_up not in (0, 1):
        raise ValueError(f"nd_up must be 0 or 1, got {nd_up!r}")
    with rt.lock:
        vids, single = _vars(rt, shared_vars)
        if nd_up == 0:
            for vid in vids:
                if rt.shareds[vid].ndim == 0:
                    raise ValueError(f"gather(nd_up=0) concatenates along axis 0, but {rt.shareds[vid]} "
                                     "is 0-d; use nd_up=1")
        env = master_env(rt)
        if rt.n > 1:
            _exec(rt, "publish", vids, (), local=lambda: None)
        results = []
        for vid in vids:
            var = rt.shareds[vid]
            dtype = _dtype(rt, vid)
            parts = [_live(var, dtype) if r == rt.rank else env.slots.view(vid, r, dtype)
                     for r in range(rt.n)]
            if len({p.shape[1 - nd_up:] for p in parts}) > 1:        # exactly what each rank holds
                results.append([np.array(p, copy=True) for p in parts])
            else:
                results.append(np.stack(parts) if nd_up == 1 else np.concatenate(parts, axis=0))
        return _one_or_tuple(results, single)


def all_gather(shared_vars, nccl=True):
    """Every rank's variable becomes the concatenation (axis 0, rank order) of all ranks'."""
    rt = get_runtime(True)
    with rt.lock:
        vids, _ = _vars(rt, shared_vars)
        for vid in vids:
            if rt.shareds[vid].ndim == 0:
                raise ValueError(f"all_gather of 0-d variable {rt.shareds[vid]} is not possible "
                                 "(it concatenates along axis 0 and keeps ndim)")
        if rt.n == 1:
            return
        _exec(rt, "all_gather", vids, ())


def scatter(shared_vars, values, batch=None):
    """Split each value (array or Data) along axis 0 (after selecting ``batch`` rows: an
    int, a slice or a list of indices) over the ranks, as evenly as possible, in rank order."""
    rt = get_runtime(True)
    with rt.lock:
        vids, single = _vars(rt, shared_vars)
        for vid in vids:
            if rt.shareds[vid].ndim == 0:
                raise ValueError(f"scatter splits along axis 0, but {rt.shareds[vid]} is 0-d")
        vals = _values(rt, vids, values, single, "scatter")
        lens = {len(v) for v in vals}
        if len(lens) > 1:
            raise ValueError(f"scatter values have different lengths {sorted(lens)}")
        length = lens.pop()
        sel = sc.normalize_batch(batch)
        idx = None
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
        for vid, v in zip(vids, vals):
            for r in range(rt.n):
                _check_static(rt.shareds[vid], (bounds[r + 1] - bounds[r],) + tuple(v.shape[1:]), "scatter")
        descs, arrays = _staged(rt, vals)
        idx_desc, idx_arr = None, None
        if idx is not None:
            (idx_desc,), (idx_arr,) = _staged_extra(rt, idx)
        env = master_env(rt)
        plan = (kind, bounds, idx_desc)

        def local():
            env.view = lambda desc: idx_arr if desc == idx_desc else arrays[descs.index(desc)]
            return _run(env, "scatter", vids, (descs, plan))
        if rt.n == 1:
            local()
        else:
            _exec(rt, "scatter", vids, (descs, plan), local=local)


def _staged_extra(rt, arr):
    desc, local = _scratch(rt, "index", 0, np.int64, arr.shape)
    np.copyto(local, arr)
    return [desc], [local]


def _check_rank(rt, rank):
    if isinstance(rank, (bool, np.bool_)) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < rt.n:
        raise ValueError(f"rank must be an int in [0, {rt.n - 1}], got {rank!r}")
    return int(rank)


def set_value(rank, shared_vars, values, batch=None):
    """Set the value (array or Data; ``batch`` selects rows of it) of shared variable(s) in
    one rank, the master's included."""
    rt = get_runtime(True)
    with rt.lock:
        rank = _check_rank(rt, rank)
        vids, single = _vars(rt, shared_vars)
        vals = _values(rt, vids, values, single, "set_value")
        sel = sc.normalize_batch(batch)
        for vid, v in zip(vids, vals):
            shape = tuple(v.shape)
            if sel is not None:
                if len(shape) == 0:
                    raise ValueError("batch needs values with at least 1 dimension")
                top = sc.sel_max(sel)
                if top > shape[0]:
                    raise IndexError(f"batch selects row {top - 1} but the value has {shape[0]} rows")
                shape = (sc.sel_length(sel, shape[0]),) + shape[1:]
            _check_static(rt.shareds[vid], shape, "set_value")
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
    """Copy of the value(s) of shared variable(s) in one rank, the master's included."""
    rt = get_runtime(True)
    with rt.lock:
        rank = _check_rank(rt, rank)
        vids, single = _vars(rt, shared_vars)
        if rank == rt.rank:
            res = [np.array(_live(rt.shareds[v], _dtype(rt, v)), copy=True) for v in vids]
            return _one_or_tuple(res, single)
        _exec(rt, "publish", vids, (rank,), local=lambda: None)
        env = master_env(rt)
        res = [np.array(env.slots.view(v, rank, _dtype(rt, v)), copy=True) for v in vids]
        return _one_or_tuple(res, single)


def get_shapes(shared_vars):
    """Shape of each variable on every rank: a list per variable (a tuple of lists for several)."""
    rt = get_runtime(True)
    with rt.lock:
        vids, single = _vars(rt, shared_vars)
        if rt.n == 1:
            mine, theirs = _op_shapes(master_env(rt), vids), {}
        else:
            mine, theirs = _exec(rt, "shapes", vids, ())
        per_rank = dict(theirs)
        per_rank[rt.rank] = mine
        res = [[tuple(per_rank[r][i]) for r in range(rt.n)] for i in range(len(vids))]
        return _one_or_tuple(res, single)


def get_lengths(shared_vars):
    """Length (axis 0) of each variable on every rank: a list per variable (a tuple of lists
    for several)."""
    rt = get_runtime(True)
    with rt.lock:
        vids, single = _vars(rt, shared_vars)
        for vid in vids:
            if rt.shareds[vid].ndim == 0:
                raise ValueError(f"{rt.shareds[vid]} is 0-d and has no length")
        shapes = get_shapes([rt.shareds[v] for v in vids])
        res = [[s[0] for s in per] for per in shapes]
        return _one_or_tuple(res, single)
