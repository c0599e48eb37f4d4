"""Collectives through shared memory among the ranks of one host ("slots").

Every rank keeps, per key, a *slot*: a segment of its own that holds its value of that
key, published with its shape in a table every rank can read.  When a caller keeps using
the slot a collective returned (a shared variable whose storage now is the slot), the next
collective finds the value already in place; otherwise the value is first copied in.

* ``all_reduce``: rank r reduces chunk r of every rank's slot (reduce-scatter) and writes
  the result into chunk r of every slot (all-gather), block by block while the block is in
  cache, so each rank reads and writes the buffer about once, like one ``np.copyto``
  split over the ranks.  Only the chunks that other ranks read are copied in: a rank reads
  its own chunk from its live array.
* ``reduce``: the same, writing only into the root's slot (or its result slot).
* ``broadcast``: every rank copies the root's slot into its own (large values: every rank
  copies one chunk of the root's slot into every slot).
* ``gatherv`` / ``all_gatherv`` / ``reduce_scatter``: ranks read each other's slots.
* small all-reduces (``_Eager``): one meeting instead of three; every rank reduces every
  rank's values itself.

Every verb has a fallible phase (allocating, attaching, checking shapes) that ends in a
vote; nothing is written before every rank voted yes, so a failure on one rank leaves
every rank's values as they were."""
import math
import struct

import numpy as np

from .. import reductions as red
from ..comm import Comm
from ..errors import Aborted
from . import shm

MAXD = 16
SLOT, RESULT, SHAPE = 0, 1, 2       # table planes: values, results, shape exchange
_TMP_BLOCK_BYTES = 1 << 18          # widened (float32/float64) accumulation blocks
_BLOCK_BYTES = 1 << 17              # in-place reduction blocks (per source), cache-resident
_SPLIT_BCAST_BYTES = 1 << 20        # broadcast of at least this much: every rank copies a chunk
_ALIGN = 64                         # chunk boundaries on cache lines
_EAGER_BYTES = 1 << 16              # eager area per rank (and parity): values
_EAGER_WORDS = 256                  # eager area per rank (and parity): token and header (int64)
_TOKEN = struct.Struct("<q")


class _Slots:
    """One rank's slots plus the table through which ranks publish their slots' shapes.

    A key has two value buffers.  The one whose view a collective last returned is *lent*:
    the caller may keep it as its value, so nothing writes into it before a vote has
    decided (the write is then the commit); staging for a collective uses the other."""

    def __init__(self, prefix, rank, n, n_keys, create):
        self.prefix, self.rank, self.n = prefix, rank, n
        rows = max(1, n_keys)
        self.table_seg = shm.Segment(f"{prefix}_slots", 3 * rows * n * (2 + MAXD) * 8, create=create)
        self.table = self.table_seg.array(np.int64, (3, rows, n, 2 + MAXD))
        self.bufs = {}    # (plane, key) -> [(gen, Segment, address) or None, same]
        self.cur = {}     # (plane, key) -> index of the buffer published now
        self.lent = {}    # key -> index of the value buffer last returned
        self.gen = {}     # (plane, key) -> last generation number used in a name
        self.peers = {}   # (plane, key, rank) -> {gen % 2: (gen, Segment)}
        self.views = {}   # (plane, key, rank, gen) -> (shape, dtype, array): the last view made

    def _buffer(self, plane, key, i, nbytes):
        bufs = self.bufs.setdefault((plane, key), [None, None])
        cur = bufs[i]
        if cur is not None and cur[1].size >= nbytes:
            return cur
        gen = self.gen.get((plane, key), 0) + 1
        gen += (gen - i) % 2             # buffer i has generations of parity i (see ``view``)
        self.gen[(plane, key)] = gen
        size = max(64, int(nbytes * (1.25 if cur else 1.0)))
        shm.check_space(size)
        seg = shm.Segment(f"{self.prefix}_v{plane}k{key}r{self.rank}g{gen}", size, create=True)
        if cur is not None:
            cur[1].unlink()
            self.views.pop((plane, key, self.rank, cur[0]), None)     # (its memory goes with it)
        bufs[i] = entry = (gen, seg, seg.address())
        return entry

    def announce(self, plane, key, gen, shape):
        if len(shape) > MAXD:
            raise ValueError(f"collectives support up to {MAXD} dimensions, got {len(shape)}")
        row = self.table[plane, key, self.rank]
        row[2:2 + len(shape)] = shape
        row[1] = len(shape)
        row[0] = gen

    def holds(self, key, arr):
        """Whether ``arr`` is exactly the lent value buffer of ``key`` (no copy-in needed)."""
        i = self.lent.get(key)
        if i is None or not isinstance(arr, np.ndarray):
            return False
        entry = self.bufs[(SLOT, key)][i]
        return (arr.flags.c_contiguous and arr.__array_interface__["data"][0] == entry[2]
                and arr.nbytes <= entry[1].size)

    def _publish_held(self, key, shape):
        i = self.lent[key]
        self.cur[(SLOT, key)] = i
        self.announce(SLOT, key, self.bufs[(SLOT, key)][i][0], shape)

    def stage(self, key, dtype, shape, reuse_lent=False):
        """A value buffer of ``key`` shaped ``shape``, published: the one not lent (unless
        ``reuse_lent``: for a write that happens only once a vote decided)."""
        shape = tuple(int(s) for s in shape)
        if len(shape) > MAXD:
            raise ValueError(f"collectives support up to {MAXD} dimensions, got {len(shape)}")
        lent = self.lent.get(key)
        i = 0 if lent is None else (lent if reuse_lent else 1 - lent)
        gen, seg, _ = self._buffer(SLOT, key, i, math.prod(shape) * dtype.itemsize)
        self.cur[(SLOT, key)] = i
        self.announce(SLOT, key, gen, shape)
        return seg.array(dtype, shape)

    def lend(self, key):
        """The value buffer published now is returned to a caller (call once committed)."""
        self.lent[key] = self.cur[(SLOT, key)]

    def ensure(self, key, dtype, shape, plane):
        """This rank's buffer of ``key`` on a result or shape plane, published."""
        shape = tuple(int(s) for s in shape)
        gen, seg, _ = self._buffer(plane, key, 0, math.prod(shape) * dtype.itemsize)
        self.cur[(plane, key)] = 0
        self.announce(plane, key, gen, shape)
        return seg.array(dtype, shape)

    def publish(self, key, arr):
        """Publish ``arr`` as this rank's value of ``key`` (copied into a staging buffer
        unless it is the lent one); returns where it lies."""
        arr = np.asarray(arr)
        if self.holds(key, arr):
            self._publish_held(key, arr.shape)
            return arr
        view = self.stage(key, arr.dtype, arr.shape)
        if arr.size and np.may_share_memory(view, arr):
            arr = np.array(arr, copy=True)
        np.copyto(view, arr)
        return view

    def shape(self, key, rank, plane=SLOT):
        row = self.table[plane, key, rank].tolist()
        return tuple(row[2:2 + row[1]])

    def view(self, key, rank, dtype, plane=SLOT):
        """The buffer of ``rank`` for ``key`` as published in the table (the same array
        object as last time when nothing changed: the per-call path makes no new views)."""
        row = self.table[plane, key, rank].tolist()
        shape = tuple(row[2:2 + row[1]])
        if rank == self.rank:
            gen, seg, _ = self.bufs[(plane, key)][self.cur[(plane, key)]]
        else:
            gen = row[0]
            # a rank keeps two value buffers and alternates between them: both stay mapped
            # here; a new generation of one (parity = which) means its owner replaced it
            mine = self.peers.setdefault((plane, key, rank), {})
            cur = mine.get(gen % 2)
            if cur is None or cur[0] != gen:
                if cur is not None:
                    self.views.pop((plane, key, rank, cur[0]), None)
                cur = mine[gen % 2] = (gen, shm.Segment(f"{self.prefix}_v{plane}k{key}r{rank}g{gen}"))
            seg = cur[1]
        made = self.views.get((plane, key, rank, gen))
        if made is not None and made[0] == shape and made[1] is dtype:
            return made[2]
        arr = seg.array(dtype, shape)
        self.views[(plane, key, rank, gen)] = (shape, dtype, arr)
        return arr


class _EagerPlan:
    """How a list of values lies in the eager area: ``header`` (bytes every rank writes),
    ``size`` (bytes of values) and ``views[parity][value][rank]`` (views shaped as the
    values)."""

    __slots__ = ("header", "size", "views")

    def __init__(self, header, size, views):
        self.header, self.size, self.views = header, size, views


class _Eager:
    """Small collectives in one meeting.

    Each rank writes its values, then their dtypes and shapes (the header), then the
    meeting's token into its row of an area every rank maps; all ranks meet once; then each
    rank checks that the headers agree and computes the whole result from every row itself
    (for a few KB, cheaper than two more meetings).  Rows whose token is the meeting's are
    complete: a rank may compute before a vote has decided.  Two areas serve alternately,
    chosen by the parity of the meeting's token: a rank writes an area again only after
    passing a later meeting, which every rank reaches only once done reading it, so no
    closing meeting ("fence") is needed."""

    def __init__(self, prefix, rank, n, create):
        self.row = row = _EAGER_WORDS * 8 + _EAGER_BYTES
        self.seg = shm.Segment(f"{prefix}_eager", 2 * n * row, create=create)
        self.mm = self.seg.mm
        self.data = [self.seg.array(np.uint8, (n, row), offset=p * n * row)[:, _EAGER_WORDS * 8:] for p in (0, 1)]
        self.n = n
        self.others = [[self._hdr(p, r) for r in range(n) if r != rank] for p in (0, 1)]   # their rows
        self.plans = {}     # (dtype, shape) per value -> _EagerPlan

    def _hdr(self, parity, rank):
        """Where rank ``rank``'s header in area ``parity`` starts (a byte offset)."""
        return (parity * self.n + rank) * self.row

    def plan(self, arrs, scale=1):
        """The ``_EagerPlan`` of values ``arrs``, or None when they do not fit (their size
        times ``scale``: a reduction costs every rank n-1 passes over them)."""
        sig = ((arrs[0].dtype, arrs[0].shape),) if len(arrs) == 1 else tuple((a.dtype, a.shape) for a in arrs)
        plan = self.plans.get(sig)
        if plan is None:
            words = [0, len(arrs)]
            layout, off = [], 0
            for dtype, shape in sig:
                if len(shape) > MAXD:
                    return None
                nbytes = math.prod(shape) * dtype.itemsize
                words += [dtype.num, len(shape), *shape]
                layout.append((off, nbytes, dtype))
                off += -(-nbytes // _ALIGN) * _ALIGN
            if len(words) >= _EAGER_WORDS or off > _EAGER_BYTES:
                return None
            words[0] = len(words)
            views = [[[self.data[p][r, o:o + nb].view(dt).reshape(shape) for r in range(self.n)]
                      for (o, nb, dt), (_, shape) in zip(layout, sig)] for p in (0, 1)]
            plan = self.plans[sig] = _EagerPlan(np.array(words, np.int64).tobytes(), off, views)
        return plan if plan.size * scale <= _EAGER_BYTES else None

    def post(self, parity, rank, arrs, plan, token):
        """Write this rank's values, header and token; returns every rank's views of each
        value (per value, a list by rank, shaped as the value)."""
        views = plan.views[parity]
        for a, vs in zip(arrs, views):
            np.copyto(vs[rank], a)
        at = self._hdr(parity, rank)
        header = plan.header
        mm = self.mm
        mm[at + 8:at + 8 + len(header)] = header
        _TOKEN.pack_into(mm, at, token)        # last: the row is complete
        return views

    def posted(self, parity, token):
        """Whether every rank's row in area ``parity`` is complete for meeting ``token``
        (this rank's is: it wrote it first)."""
        mm = self.mm
        for at in self.others[parity]:
            if _TOKEN.unpack_from(mm, at)[0] != token:
                return False
        return True

    def late(self, parity, token):
        """The ranks whose rows are not complete for meeting ``token``."""
        return [r for r in range(self.n) if _TOKEN.unpack_from(self.mm, self._hdr(parity, r))[0] != token]

    def agree(self, parity, plan):
        """Whether every rank posted the same dtypes and shapes."""
        header, mm = plan.header, self.mm
        size = len(header) + 8
        for at in self.others[parity]:
            if mm[at + 8:at + size] != header:
                return False
        return True

    def shapes(self, parity, i):
        """Every rank's shape of value ``i`` (for messages)."""
        out = []
        for r in range(self.n):
            at = self._hdr(parity, r) + 8
            w = np.frombuffer(self.mm, np.int64, _EAGER_WORDS - 1, at).tolist()
            pos = 2
            for _ in range(i):
                pos += 2 + w[pos + 1]
            out.append(tuple(w[pos + 2:pos + 2 + w[pos + 1]]))
        return out


_LEAN = {}      # (op, dtype) -> whether it accumulates in its own dtype (no float16 kernel)


def _small_reduce(op, srcs, out):
    """Reduce ``srcs`` (rank order, shaped alike) into the new ``out``: the same values as
    ``_reduce_chunk``, with less bookkeeping."""
    dtype = out.dtype
    lean = _LEAN.get((op, dtype))
    if lean is None:
        lean = _LEAN[(op, dtype)] = dtype != np.float16 and red.accumulator(op, dtype) == dtype
    if not lean:
        return _reduce_chunk(op, [s.reshape(-1) for s in srcs], [out.reshape(-1)], 0, out.size, dtype)
    fn = red.UFUNC[op]
    fn(srcs[0], srcs[1], out=out)
    for x in srcs[2:]:
        fn(out, x, out=out)
    if op == "avg":
        red.finish(op, out, len(srcs), dtype)


def _chunks(size, n, itemsize):
    """Chunk boundaries of ``size`` items over ``n`` ranks, on cache-line multiples."""
    q = max(1, _ALIGN // max(1, itemsize))
    nq = -(-size // q)
    b = [min(size, (r * nq // n) * q) for r in range(n + 1)]
    b[-1] = size
    return b


def _blocks(shape, counts, n, name=None):
    """Row boundaries (n+1 ints) of the ranks' blocks of axis 0 for reduce_scatter: near-equal
    (``counts`` None) or ``counts[r]`` rows for rank r (checked here, before any wait)."""
    of = f" of {name}" if name else ""
    if len(shape) == 0:
        raise ValueError(f"reduce_scatter{of} splits along axis 0 and needs at least 1 dimension")
    if counts is None:
        return [(r * shape[0]) // n for r in range(n + 1)]
    counts = [int(c) for c in counts]
    if len(counts) != n or min(counts) < 0 or sum(counts) != shape[0]:
        raise ValueError(f"reduce_scatter{of}: counts {counts} must give each of the {n} rank(s) a "
                         f"number of rows >= 0, {shape[0]} in all")
    return [sum(counts[:r]) for r in range(n + 1)]


def _addr(a):
    return a.__array_interface__["data"][0]


def _reduce_chunk(op, srcs, dsts, a, b, dtype):
    """Reduce elements [a, b) of the flat ``srcs`` (rank order) into every flat ``dsts``.

    Ops that accumulate in their own dtype write straight into the first destination
    (when that is safe: it is srcs[0], srcs[1] or no source at all) and copy the block to
    the others while it is in cache; widened ops go through a small temporary block."""
    if b <= a:
        return
    n = len(srcs)
    if n == 1:                               # one rank: the value itself
        for d in dsts:
            if _addr(d) != _addr(srcs[0]):
                np.copyto(d[a:b], srcs[0][a:b])
        return
    if dtype == np.float16:                  # numpy's float16 casts are ~100x slower: numba
        from . import half
        if half.reduce_chunk(op, srcs, dsts, a, b):
            return
    fn = red.UFUNC[op]
    wide = red.accumulator(op, dtype)
    d0 = None
    if wide == dtype:
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
            red.finish(op, t, n, dtype)
            for o in others:
                np.copyto(o[s:e], t)
        return
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
        red.finish(op, t, n, dtype)
        for d in dsts:
            np.copyto(d[s:e], t, casting="unsafe")


class ShmComm(Comm):
    """Collectives among the ranks of one host, through shared-memory slots.

    ``sync`` is the control plane of the same ranks (barrier, vote, abort)."""

    name = "shm"
    returns_new = ("all_gatherv", "reduce_scatter")   # verbs whose results are new arrays

    def __init__(self, prefix, rank, n, sync, create):
        self.prefix, self.rank, self.n = prefix, rank, n
        self.sync, self.create = sync, create
        self.slots = self.eager = None
        self.names = {}

    def accepts(self, verb, dtype, op=None, placement="host"):
        return placement == "host"

    def setup(self, n_keys, names=None):
        self.names = dict(names or {})
        if self.slots is None:
            self.slots = _Slots(self.prefix, self.rank, self.n, max(64, n_keys), self.create)
            self.eager = _Eager(self.prefix, self.rank, self.n, self.create)

    # ---- helpers ---------------------------------------------------------------------------
    def _commit(self, write):
        """Vote; run ``write`` on every rank once all voted yes, else raise Aborted."""
        if not self.sync.vote(True, on_commit=write):
            raise Aborted("another rank failed during this collective")

    def _stage(self, key, arr):
        """Copy-in for a reduction: returns ``(own flat source, shape)``.

        If ``arr`` is not the slot, every chunk but this rank's own is copied into the slot
        (the others read those); this rank reads its own chunk from ``arr``."""
        slots = self.slots
        arr = np.asarray(arr)
        if slots.holds(key, arr):
            slots._publish_held(key, arr.shape)
            return arr.reshape(-1), arr.shape
        view = slots.stage(key, arr.dtype, arr.shape).reshape(-1)
        flat = np.ascontiguousarray(arr).reshape(-1)
        if flat.size and np.may_share_memory(view, flat):
            flat = flat.copy()
        bounds = _chunks(flat.size, self.n, arr.dtype.itemsize)
        a, b = bounds[self.rank], bounds[self.rank + 1]
        if a > 0:
            np.copyto(view[:a], flat[:a])
        if b < flat.size:
            np.copyto(view[b:], flat[b:])
        return flat, arr.shape

    def _equal_shapes(self, keys, what):
        for key in keys:
            rows = self.slots.table[SLOT, key].tolist()
            if all(r[1:2 + r[1]] == rows[0][1:2 + rows[0][1]] for r in rows):
                continue
            shapes = [self.slots.shape(key, r) for r in range(self.n)]
            if len(set(shapes)) > 1:
                of = f" of {self.names[key]}" if key in self.names else ""
                raise ValueError(f"{what}{of} needs the same shape on every rank, got {shapes} (by rank)")

    def _all_slots(self, key, dtype, plane=SLOT):
        return [self.slots.view(key, r, dtype, plane).reshape(-1) for r in range(self.n)]

    def _prepare_reduction(self, items, what):
        """Stage, meet, check shapes (every rank raises alike), attach every rank's slots."""
        staged = [self._stage(key, arr) for key, arr in items]
        self.sync.barrier(check_after=False)
        self._equal_shapes([k for k, _ in items], what)
        views = [self._all_slots(key, np.asarray(arr).dtype) for key, arr in items]
        return staged, views

    def _sources(self, views, flat):
        srcs = list(views)
        srcs[self.rank] = flat                 # own chunk from the live array (maybe the slot)
        return srcs

    # ---- verbs ---------------------------------------------------------------------------
    def all_reduce(self, items, op, fence=True, scratch=False, owned=False):
        """``scratch`` (an in-graph op or a training step: the results are a call's
        intermediate values): no vote before the write; a rank that fails aborts the call,
        whose updates no rank then applies.  Small values (``_Eager``) come back as new
        arrays, larger ones as this rank's slot (a copy if ``owned``)."""
        if self.n == 1:
            return [np.asarray(a) for _, a in items]
        arrs = [np.asarray(a) for _, a in items]
        plan = self.eager.plan(arrs, self.n - 1)
        if plan is not None:
            return self._eager_all_reduce(items, arrs, plan, op, scratch)
        staged, views = self._prepare_reduction(items, "all_reduce")

        def write():
            for (key, _), (flat, _), vs in zip(items, staged, views):
                bounds = _chunks(flat.size, self.n, flat.dtype.itemsize)
                _reduce_chunk(op, self._sources(vs, flat), vs, bounds[self.rank], bounds[self.rank + 1],
                              flat.dtype)
                self.slots.lend(key)
        if scratch:
            write()
        else:
            self._commit(write)
        if fence:
            self.sync.barrier()
        res = [vs[self.rank].reshape(shape) for (_, shape), vs in zip(staged, views)]
        return [np.array(r, copy=True) for r in res] if owned else res

    def _eager_all_reduce(self, items, arrs, plan, op, scratch):
        """All-reduce of small values in one meeting (``_Eager``); new result arrays."""
        eager, rank = self.eager, self.rank
        out = [np.empty(a.shape, a.dtype) for a in arrs]     # (before the vote: nothing after it fails)
        token = self.sync.next_token()
        parity = token & 1
        views = eager.post(parity, rank, arrs, plan, token)
        done = []

        def compute():
            if done:
                return
            self._eager_check(parity, plan, items)    # every rank reads the same headers: all raise alike
            for res, vs in zip(out, views):
                _small_reduce(op, vs, res)
            done.append(True)
        if scratch:                        # the rows' tokens are the arrivals
            self.sync.meet(lambda: eager.posted(parity, token), lambda: eager.late(parity, token))
            compute()
            return out

        def meanwhile():                  # while the vote is decided: every row is complete
            if eager.posted(parity, token) and eager.agree(parity, plan):
                compute()                 # (only kept if the vote commits)
        if not self.sync.vote(True, on_commit=compute, meanwhile=meanwhile):
            raise Aborted("another rank failed during this collective")
        return out

    def _eager_check(self, parity, plan, items):
        """ValueError (on every rank alike) unless every rank posted the same shapes."""
        eager = self.eager
        if eager.agree(parity, plan):
            return
        for i, (key, _) in enumerate(items):
            shapes = eager.shapes(parity, i)
            if len(set(shapes)) > 1:
                of = f" of {self.names[key]}" if key in self.names else ""
                raise ValueError(f"all_reduce{of} needs the same shape on every rank, got {shapes} (by rank)")
        raise ValueError("all_reduce needs the same values (dtypes, shapes) on every rank")

    def reduce(self, items, op, root, in_place=True, fence=True):
        """``in_place``: the root's result is its slot of the key (its value is replaced);
        otherwise a separate result buffer (valid until the next reduce of that key)."""
        if self.n == 1:
            return [np.asarray(a) if in_place else np.array(a, copy=True) for _, a in items]
        if self.rank == root and not in_place:
            for key, arr in items:
                arr = np.asarray(arr)
                self.slots.ensure(key, arr.dtype, arr.shape, plane=RESULT)
        staged, views = self._prepare_reduction(items, "reduce")
        plane = SLOT if in_place else RESULT
        dests = [vs[root] if in_place else self.slots.view(key, root, np.asarray(arr).dtype, RESULT).reshape(-1)
                 for (key, arr), vs in zip(items, views)]

        def write():
            for (key, _), (flat, _), vs, dest in zip(items, staged, views, dests):
                bounds = _chunks(flat.size, self.n, flat.dtype.itemsize)
                _reduce_chunk(op, self._sources(vs, flat), [dest], bounds[self.rank], bounds[self.rank + 1],
                              flat.dtype)
                if in_place and self.rank == root:
                    self.slots.lend(key)
        self._commit(write)
        if fence:
            self.sync.barrier()
        if self.rank != root:
            return None
        return [self.slots.view(key, root, np.asarray(arr).dtype, plane).reshape(shape)
                for (key, arr), (_, shape) in zip(items, staged)]

    def broadcast(self, items, root, fence=True):
        if self.n == 1:
            return [np.asarray(a) for _, a, _ in items]
        if self.rank == root:                # staged in the buffer not lent: until the vote,
            for key, arr, dtype in items:     # the root's old value stays intact
                self.slots.publish(key, np.asarray(arr, dtype=dtype))
        self.sync.barrier(check_after=False)
        targets = []
        for key, _, dtype in items:
            dtype = np.dtype(dtype)
            shape = self.slots.shape(key, root)
            src = self.slots.view(key, root, dtype)
            dst = src if self.rank == root else self.slots.stage(key, dtype, shape, reuse_lent=True)
            targets.append((key, dtype, src, dst))
        total = sum(src.nbytes for _, _, src, _ in targets)
        split = total >= _SPLIT_BCAST_BYTES
        if split:
            self.sync.barrier()        # every rank has sized its slot: now attach them all
            flats = [self._all_slots(key, dtype) for key, dtype, _, _ in targets]

        def write():
            for key, _, _, _ in targets:
                self.slots.lend(key)
            if not split:
                for _, _, src, dst in targets:
                    if dst is not src:
                        np.copyto(dst, src)
                return
            for (_, dtype, src, _), vs in zip(targets, flats):
                s = src.reshape(-1)
                bounds = _chunks(s.size, self.n, dtype.itemsize)
                a, b = bounds[self.rank], bounds[self.rank + 1]
                for r in range(self.n):
                    if r != root and b > a:
                        np.copyto(vs[r][a:b], s[a:b])
        self._commit(write)
        if fence:
            self.sync.barrier()
        return [dst for _, _, _, dst in targets]

    def _publish_all(self, items):
        for key, arr in items:
            self.slots.publish(key, arr)
        self.sync.barrier()

    def gatherv(self, items, root, fence=True):
        if self.n == 1:
            return [[np.array(a, copy=True)] for _, a in items]
        if self.rank != root:
            self._publish_all(items)
            if fence:
                self.sync.barrier()
            return None
        self.sync.barrier()              # the root reads its own value where it is
        out = []
        for key, arr in items:
            arr = np.asarray(arr)
            out.append([np.array(arr if r == root else self.slots.view(key, r, arr.dtype), copy=True)
                        for r in range(self.n)])
        if fence:
            self.sync.barrier()
        return out

    def all_gatherv(self, items, fence=True):
        if self.n == 1:
            return [np.array(a, copy=True) for _, a in items]
        self._publish_all(items)
        parts = []
        for key, arr in items:
            arr = np.asarray(arr)
            ps = [self.slots.view(key, r, arr.dtype) for r in range(self.n)]
            if ps[0].ndim == 0 or len({p.shape[1:] for p in ps}) > 1:
                of = f" of {self.names[key]}" if key in self.names else ""
                raise ValueError(f"all_gather{of} concatenates along axis 0 and needs equal trailing shapes "
                                 f"of at least 1 dimension; got {[p.shape for p in ps]} (by rank)")
            parts.append(ps)
        out = [np.concatenate(ps, axis=0) for ps in parts]
        self.sync.barrier()              # nobody reads the slots any more
        return out

    def reduce_scatter(self, items, op, fence=True, counts=None):
        """``counts``: None, or per item None (near-equal blocks) or the rows each rank gets.

        Every rank publishes its whole array (the others read every block but their own
        from it), checks the shapes (every rank raises alike) and, once all voted yes,
        reduces its own block from every rank's slot into a new array."""
        counts = [None] * len(items) if counts is None else list(counts)
        if len(counts) != len(items):
            raise ValueError(f"reduce_scatter got {len(counts)} counts for {len(items)} items")
        blocks = [_blocks(np.shape(arr), c, self.n, self.names.get(key)) for (key, arr), c in zip(items, counts)]
        if self.n == 1:
            return [np.array(a, copy=True) for _, a in items]
        for key, arr in items:
            self.slots.publish(key, arr)
        self.sync.barrier(check_after=False)
        self._equal_shapes([k for k, _ in items], "reduce_scatter")
        out = []
        for (key, arr), rows in zip(items, blocks):
            arr = np.asarray(arr)
            per = int(np.prod(arr.shape[1:]))
            a, b = rows[self.rank] * per, rows[self.rank + 1] * per
            res = np.empty((rows[self.rank + 1] - rows[self.rank],) + arr.shape[1:], arr.dtype)
            out.append((res, [v[a:b] for v in self._all_slots(key, arr.dtype)]))

        def write():
            for res, srcs in out:
                _reduce_chunk(op, srcs, [res.reshape(-1)], 0, res.size, res.dtype)
        self._commit(write)
        self.sync.barrier()              # slots may change only once every rank has read them
        return [res for res, _ in out]

    def shapes(self, shapes):
        if self.n == 1:
            return [[tuple(s)] for s in shapes]
        for i, s in enumerate(shapes):
            self.slots.announce(SHAPE, i, 0, tuple(s))
        self.sync.barrier()
        out = [[self.slots.shape(i, r, SHAPE) for r in range(self.n)] for i in range(len(shapes))]
        self.sync.barrier()
        return out

    def barrier(self):
        self.sync.barrier()
