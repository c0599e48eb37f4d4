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

import numpy as np

from .chunks import chunk_bounds, row_blocks, reduce_chunk, small_reduce
from .parallel import split_run, threads_for
from .slots import RESULT, SHAPE, SLOT, Eager, Slots
from ...errors import Aborted

_SPLIT_BCAST_BYTES = 1 << 20        # broadcast of at least this much: every rank copies a chunk


class ShmComm:
    """Collectives among the ranks of one host, through shared-memory slots.

    ``sync`` is the control plane of the same ranks (barrier, vote, abort)."""

    name = "shm"
    returns_new = ("all_gatherv", "reduce_scatter")   # verbs whose results are new arrays

    def __init__(self, prefix, rank, n, sync, create):
        self.prefix, self.rank, self.n = prefix, rank, n
        self.sync, self.create = sync, create
        self.slots = self.eager = None
        self.names = {}
        self.threads = threads_for(n)        # for this rank's share of a large collective

    def accepts(self, verb, dtype, op=None, placement="host"):
        return placement == "host"

    def setup(self, n_keys, names=None):
        self.names = dict(names or {})
        if self.slots is None:
            self.slots = Slots(self.prefix, self.rank, self.n, max(64, n_keys), self.create)
            self.eager = Eager(self.prefix, self.rank, self.n, self.create)

    # ---- helpers ---------------------------------------------------------------------------
    def _commit(self, write):
        """Vote; run ``write`` on every rank once all voted yes, else raise Aborted."""
        if not self.sync.vote(True, on_commit=write):
            raise Aborted("another rank failed during this collective")

    def _stage(self, key, arr, own=None):
        """Copy-in for a reduction: returns ``(own flat source, shape)``.

        If ``arr`` is not the slot, every chunk but this rank's own (elements ``own``, by
        default its chunk of ``chunk_bounds``) is copied into the slot (the others read
        those); this rank reads its own chunk from ``arr``."""
        slots = self.slots
        arr = np.asarray(arr)
        if slots.holds(key, arr):
            slots.publish_held(key, arr.shape)
            return arr.reshape(-1), arr.shape
        view = slots.stage(key, arr.dtype, arr.shape).reshape(-1)
        flat = np.ascontiguousarray(arr).reshape(-1)
        if flat.size and np.may_share_memory(view, flat):
            flat = flat.copy()
        if own is None:
            bounds = chunk_bounds(flat.size, self.n, arr.dtype.itemsize)
            own = bounds[self.rank], bounds[self.rank + 1]
        a, b = own
        copy = lambda lo, hi: np.copyto(view[lo:hi], flat[lo:hi])     # noqa: E731
        if a > 0:
            split_run(copy, 0, a, flat.itemsize, self.threads)
        if b < flat.size:
            split_run(copy, b, flat.size, flat.itemsize, self.threads)
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

    def _prepare_reduction(self, items, what, arrs=None):
        """Stage, meet, check shapes (every rank raises alike), attach every rank's slots.
        ``arrs`` (an all-reduce, whose ranks may go different ways: see ``_meet_signed``):
        the values, met on with their signature."""
        staged = [self._stage(key, arr) for key, arr in items]
        if arrs is None:
            self.sync.barrier(check_after=False)
            self._equal_shapes([k for k, _ in items], what)
        else:
            self._meet_signed(items, arrs, what)
        views = [self._all_slots(key, np.asarray(arr).dtype) for key, arr in items]
        return staged, views

    def _meet_signed(self, items, arrs, what):
        """The first meeting of an all-reduce that does not go the one-meeting way: on the
        eager rows, with this rank's signature (dtypes and shapes) in its row.  How an
        all-reduce goes (one meeting, slots, a device) depends on the size of a rank's own
        values: ranks whose shapes differ may choose differently, and would otherwise wait
        in different meetings for ever; here they meet and every rank raises alike."""
        eager = self.eager
        header = eager.header(arrs)
        token = self.sync.next_token()
        parity = token & 1
        eager.sign(parity, self.rank, header, token)
        self.sync.meet(lambda: eager.posted(parity, token), lambda: eager.late(parity, token))
        self._check_signed(parity, header, items, what)

    def _reduce(self, op, srcs, dsts, flat):
        """This rank's chunk of the reduction of ``srcs`` into ``dsts`` (its threads)."""
        bounds = chunk_bounds(flat.size, self.n, flat.dtype.itemsize)
        split_run(lambda lo, hi: reduce_chunk(op, srcs, dsts, lo, hi, flat.dtype), bounds[self.rank],
                  bounds[self.rank + 1], flat.dtype.itemsize, self.threads)

    def _sources(self, views, flat):
        srcs = list(views)
        srcs[self.rank] = flat                 # own chunk from the live array (maybe the slot)
        return srcs

    # ---- verbs ---------------------------------------------------------------------------
    def all_reduce(self, items, op, fence=True, scratch=False, owned=False):
        """``scratch`` (an in-graph op or a training step: the results are a call's
        intermediate values): no vote before the write; a rank that fails aborts the call,
        whose updates no rank then applies.  Small values (``Eager``) come back as new
        arrays, larger ones as this rank's slot (a copy if ``owned``)."""
        if self.n == 1:
            return [np.asarray(a) for _, a in items]
        arrs = [np.asarray(a) for _, a in items]
        plan = self.eager.plan(arrs, self.n - 1)
        if plan is not None:
            return self._eager_all_reduce(items, arrs, plan, op, scratch)
        staged, views = self._prepare_reduction(items, "all_reduce", arrs)

        def write():
            for (key, _), (flat, _), vs in zip(items, staged, views):
                self._reduce(op, self._sources(vs, flat), vs, flat)
                self.slots.lend(key, tentative=scratch)
        if scratch:
            write()
        else:
            self._commit(write)
        if fence:
            self.sync.barrier()
        res = [vs[self.rank].reshape(shape) for (_, shape), vs in zip(staged, views)]
        return [np.array(r, copy=True) for r in res] if owned else res

    def _eager_all_reduce(self, items, arrs, plan, op, scratch):
        """All-reduce of small values in one meeting (``Eager``); new result arrays."""
        eager, rank = self.eager, self.rank
        out = [np.empty(a.shape, a.dtype) for a in arrs]     # (before the vote: nothing after it fails)
        token = self.sync.next_token()
        parity = token & 1
        views = eager.post(parity, rank, arrs, plan, token)
        done = []

        def compute():
            if done:
                return
            self._check_signed(parity, plan.header, items, "all_reduce")   # (the same headers: all raise alike)
            for res, vs in zip(out, views):
                small_reduce(op, vs, res)
            done.append(True)
        if scratch:                        # the rows' tokens are the arrivals
            self.sync.meet(lambda: eager.posted(parity, token), lambda: eager.late(parity, token))
            compute()
            return out

        def meanwhile():                  # while the vote is decided: every row is complete
            if eager.posted(parity, token) and eager.agree(parity, plan.header):
                compute()                 # (only kept if the vote commits)
        if not self.sync.vote(True, on_commit=compute, meanwhile=meanwhile):
            if eager.posted(parity, token):    # every rank met: raise as those that saw unequal shapes
                self._check_signed(parity, plan.header, items, "all_reduce")
            raise Aborted("another rank failed during this collective")
        return out

    def _check_signed(self, parity, header, items, what):
        """ValueError (on every rank alike) unless every rank signed ``header``."""
        eager = self.eager
        if eager.agree(parity, header):
            return
        for i, (key, _) in enumerate(items):
            shapes = eager.shapes(parity, i)
            if None in shapes:      # a digest (many values): the shapes of the ranks that have slots
                shapes = [self.slots.shape(key, r) if s is None else s for r, s in enumerate(shapes)]
            if len(set(shapes)) > 1:
                of = f" of {self.names[key]}" if key in self.names else ""
                raise ValueError(f"{what}{of} needs the same shape on every rank, got {shapes} (by rank)")
        raise ValueError(f"{what} needs the same values (dtypes, shapes) on every rank")

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
                self._reduce(op, self._sources(vs, flat), [dest], flat)
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
                bounds = chunk_bounds(s.size, self.n, dtype.itemsize)
                a, b = bounds[self.rank], bounds[self.rank + 1]
                for r in range(self.n):
                    if r != root and b > a:
                        np.copyto(vs[r][a:b], s[a:b])
        self._commit(write)
        if fence:
            self.sync.barrier()
        return [dst for _, _, _, dst in targets]

    def _publish_all(self, items, check_after=True):
        for key, arr in items:
            self.slots.publish(key, arr)
        self.sync.barrier(check_after)

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
        self._publish_all(items, check_after=False)     # (shapes checked below: every rank raises alike)
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

    def reduce_scatter(self, items, op, fence=True, counts=None, scratch=False):
        """``counts``: None, or per item None (near-equal blocks) or the rows each rank gets.

        Every rank stages every block of its array but its own (the others read those),
        checks the shapes (every rank raises alike) and, once all voted yes (``scratch``: at
        once: the results are new arrays of a call, which a failed call never keeps), reduces
        its own block from every other rank's slot and its own live array into a new array."""
        counts = [None] * len(items) if counts is None else list(counts)
        if len(counts) != len(items):
            raise ValueError(f"reduce_scatter got {len(counts)} counts for {len(items)} items")
        blocks = [row_blocks(np.shape(arr), c, self.n, self.names.get(key)) for (key, arr), c in zip(items, counts)]
        if self.n == 1:
            return [np.array(a, copy=True) for _, a in items]
        owns = []                        # every block but this rank's own into the slot
        for (key, arr), rows in zip(items, blocks):
            per = int(math.prod(np.shape(arr)[1:]))
            own = rows[self.rank] * per, rows[self.rank + 1] * per
            owns.append((own, self._stage(key, arr, own)[0]))
        self.sync.barrier(check_after=False)
        self._equal_shapes([k for k, _ in items], "reduce_scatter")
        out = []
        for (key, arr), rows, ((a, b), flat) in zip(items, blocks, owns):
            arr = np.asarray(arr)
            res = np.empty((rows[self.rank + 1] - rows[self.rank],) + arr.shape[1:], arr.dtype)
            out.append((res, [v[a:b] for v in self._sources(self._all_slots(key, arr.dtype), flat)]))

        def write():
            for res, srcs in out:
                reduce_chunk(op, srcs, [res.reshape(-1)], 0, res.size, res.dtype)
        if scratch:
            write()
        else:
            self._commit(write)
        self.sync.barrier()              # slots may change only once every rank has read them
        return [res for res, _ in out]

    def read_all(self, items, use, what, scratch=False, fill=None):
        """For callers that combine the ranks' values elsewhere (on a device): every rank
        publishes its whole value of each item in its slot (equal shapes checked: every rank
        raises alike), then ``use(views)`` runs on every rank, ``views[i][r]`` being rank
        r's value of item i (read-only views of the slots, valid only inside ``use``); its
        result is returned once every rank's ``use`` succeeded (the all-or-nothing vote;
        ``scratch``: no vote, a meeting).  No slot is written here after the first meeting.
        ``fill(i, slot)``, if given, writes this rank's value of item i into its slot itself
        (a GPU's copy engine straight into the page-locked slot, no host copy); the items'
        values then need only a ``shape`` and a ``dtype``."""
        if self.n == 1:
            return use([[np.asarray(a)] for _, a in items])
        if fill is None:
            for key, arr in items:
                self._stage(key, arr, own=(0, 0))     # the whole value: every other rank reads it
            arrs = [np.asarray(a) for _, a in items]
        else:
            arrs = [self.slots.stage(key, np.dtype(a.dtype), a.shape) for key, a in items]
            for i, slot in enumerate(arrs):
                fill(i, slot)
        self._meet_signed(items, arrs, what)           # (others may go the host's way)
        views = [[self.slots.view(key, r, arr.dtype) for r in range(self.n)] for (key, _), arr in zip(items, arrs)]
        out = use(views)
        if scratch:
            self.sync.barrier()          # every rank has read the slots
        else:
            self._commit(lambda: None)   # (a rank votes once it has read them)
        return out

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

    def settle(self, committed):
        if self.slots is not None:          # (none before ``setup``)
            self.slots.settle(committed)

    def close(self):
        pass                     # (the session's segments are removed by prefix)
