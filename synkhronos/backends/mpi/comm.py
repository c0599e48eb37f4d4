"""The ``hier`` collectives of a session spanning several hosts: shared memory among the
ranks of a host (the ``shm`` slots), one MPI collective between hosts on a host buffer
(run by the host's MPI process; a host's one rank all-reduces in its own value buffer),
shared memory again to give every rank the result."""
import math
import time

import numpy as np

from .requests import Pending, Requests, abandon
from .world import OP_HOT
from ..shm import segments as shm
from ..shm.chunks import chunk_bounds, row_blocks
from ..shm.control import step_token
from ..shm.slots import RESULT, Slots
from ... import reductions as red
from ... import signals
from ...errors import Aborted
from ...kernels import half

ABORT_GRACE_S = 0.5      # an aborted operation between hosts may still complete: how long to let it
# hosts seen finished while the operation is not yet tested complete here never joined it only
# once it stays so this long and through this many more tests (a pause of this process tests nothing)
FINISHED_GRACE_S, FINISHED_LOOKS = 1.0, 5


class HierComm:
    """Collectives of a session spanning several hosts, as every rank runs them: shared
    memory among the ranks of a host, one MPI collective between hosts on a host buffer
    (run by the host's MPI process), shared memory again to give every rank the result.
    Nothing any rank can see changes before every rank of every host is ready: a vote, or
    for a reduction the hosts' agreement on the shapes, made by their MPI processes in the
    same request as the exchange of the data (its commit: no vote, no turn through the ranks
    between the two)."""

    name = "hier"
    returns_new = ("all_gatherv", "reduce_scatter", "gatherv")   # verbs whose results are new arrays

    def __init__(self, prefix, slot, control, create, host_index, host_sizes, grank, w=None, coll=None):
        self.prefix, self.slot, self.ctl = prefix, slot, control
        self.members = control.members
        self.pos = self.members.index(slot)            # my place among the host's ranks
        self.k = len(self.members)
        self.create, self.w = create, w                # w: MPI (the master only)
        self.coll = coll                               # requests.Collectives (the master only)
        self.host_index, self.host_sizes = host_index, list(host_sizes)
        self.grank, self.n = grank, sum(host_sizes)
        self.slots = None
        self.requests = None
        self.names = {}
        self.steps = 0        # this command's host steps (every rank of the host counts alike)
        self.step_seq = -1
        self.made = 0
        self.hbufs = {}       # (key, kind) -> Segment this rank owns (the first rank of the host)
        self.attached = {}    # (key, kind) -> (name, Segment): the current host buffer only
        self.mpi_buffers = {}
        self.retire = False   # an MPI operation of this rank's host did not end as answered

    def accepts(self, verb, dtype, op=None, placement="host"):
        return placement == "host"

    def setup(self, n_keys, names=None):
        self.names = dict(names or {})
        if self.slots is None:
            self.slots = Slots(self.prefix, self.slot, self.ctl.n, max(64, n_keys), self.create)
            self.requests = Requests(self.prefix, self.create)

    def close(self):
        for seg in self.hbufs.values():
            seg.unlink()
        self.hbufs.clear()
        if self.coll is not None:
            self.coll.free()

    # ---- helpers ---------------------------------------------------------------------------
    def _token(self):
        if self.ctl.seq != self.step_seq:           # a new command: its steps count from 1
            self.step_seq, self.steps = self.ctl.seq, 0
        self.steps += 1
        return step_token(self.ctl.seq, self.steps)

    def _host(self, obj_for_first):
        """The first rank's object, on every rank of the host (through the request segment)."""
        token = self._token()
        if self.pos == 0:
            self.requests.answer(token, obj_for_first)
        self.ctl.host_barrier()
        return self.requests.answer_obj(token)

    def _mpi(self, req):
        """One MPI operation of this host with the other hosts: the first rank asks the
        host's MPI process (the master runs it itself); every rank gets the answer."""
        token = self._token()
        if self.pos == 0:
            self.retire = True                       # until answered: see _host_buffer
            if self.w is not None:                   # the master: its host's MPI process
                op, done, aborted = None, [], []

                def ready():                         # (watching the other hosts meanwhile)
                    if op.look():
                        done.append(True)
                        return True
                    # a rank that failed before its host's MPI process joined (e.g. in the
                    # gradient before a step's all-reduce): the operation can never complete.
                    # But the other hosts may have completed it and failed after it, alike
                    # (shapes every rank checks): it then completes here too in a moment
                    if not self.ctl.aborted():
                        return False
                    now = time.monotonic()
                    if not aborted:
                        aborted.append(now)
                    return now - aborted[0] > ABORT_GRACE_S
                try:
                    # (an interrupt finds the operation started and known; once the hosts
                    # agree and before its data moves, interrupts wait for the command's
                    # end: every host then completes it, as after a vote)
                    with signals.deferred():
                        op = Pending(self.coll.comm, self.w.MPI, req, self.mpi_buffers, on_agreed=signals.hold)
                    self.ctl.waiter.wait(ready, self.ctl.sleep, owed=lambda: [],
                                         what="a collective between hosts", keep_hot=OP_HOT,
                                         hopeless=self._others_finished())
                    if not done:
                        raise Aborted("another rank failed during this collective")
                except BaseException:
                    if op is not None:
                        abandon(op)
                        self.coll.abandoned = True
                    raise
                self.requests.answer(token, op.result)
            else:
                self.requests.write(token, req)
                self.ctl.hand_off([self.ctl.lead])   # the host's MPI process may be asleep
                self.ctl.waiter.wait(lambda: self.requests.answered(token) or self.ctl.aborted(), self.ctl.sleep,
                                     owed=lambda: [], what="a collective between hosts")
                if not self.requests.answered(token):
                    raise Aborted("another rank failed during this collective")
            self.retire = False
        # every rank of the host has the answer or soon will: the other hosts may have it too
        # and fail alike right after it (unequal shapes, checked on every rank), aborting the
        # command before this host's ranks met; the meeting still completes (then every rank
        # raises the same error), else Aborted
        self.ctl.host_barrier(grace=ABORT_GRACE_S)
        return self.requests.answer_obj(token)

    def _others_finished(self):
        """A check for the master's wait in an operation between hosts: RuntimeError once
        every rank of another host has finished the command and the operation still has
        not completed here ``FINISHED_GRACE_S`` seconds and ``FINISHED_LOOKS`` tests later:
        that host never joins it.  Seen finished alone is no proof: a host that took part
        finishes while the operation's last step here still waits for MPI's progress."""
        seen = []

        def check():
            if self.coll.finished is None or self.ctl.aborted():   # (a failure: the abort ends the wait)
                return
            hosts = self.coll.finished(self.ctl.seq)
            if not hosts:
                seen.clear()
                return
            now = time.monotonic()
            if not seen:
                seen[:] = [now, 0]
            seen[1] += 1                 # (each look follows a test of the operation)
            if now - seen[0] < FINISHED_GRACE_S or seen[1] < FINISHED_LOOKS:
                return
            raise RuntimeError(
                f"the ranks of host(s) {', '.join(hosts)} finished their part of this command while the "
                "master's host waits for them in a collective between hosts: the ranks ran different "
                "numbers of collectives (a scan or loop over a rank's own rows?); every rank must run "
                "the same collectives in the same order")
        return check

    def _host_buffer(self, key, kind, dtype, count):
        """A buffer of the host (owned by its first rank) for ``key``: every rank's view, and
        its name."""
        name = self._attach(key, kind, dtype, count)
        return self._host_view(key, kind, dtype, count), name

    def _host_view(self, key, kind, dtype, count):
        return self.attached[(key, kind)][1].array(np.dtype(dtype), (count,))

    def _attach(self, key, kind, dtype, count):
        """Make (the host's first rank) and map (every rank) the host buffer for ``key``;
        its name."""
        dtype = np.dtype(dtype)
        nbytes = max(64, count * dtype.itemsize)
        name = None
        if self.pos == 0:
            if self.retire:            # an operation between hosts was given up on: it may
                self.retire = False    # still write to the host buffers, new ones from now on
                for seg in self.hbufs.values():
                    seg.unlink()
                self.hbufs.clear()
                self.attached.clear()
            seg = self.hbufs.get((key, kind))
            if seg is None or seg.size < nbytes:
                if seg is not None:
                    seg.unlink()
                self.made += 1
                shm.check_space(nbytes)
                seg = self.hbufs[(key, kind)] = shm.Segment(
                    f"{self.prefix}_h{kind}{key}x{self.made}", int(nbytes * 1.25), create=True)
            name = seg.name
        name = self._host(name)
        cur = self.attached.get((key, kind))
        if cur is None or cur[0] != name:       # (a replaced buffer is unmapped here)
            self.attached[(key, kind)] = (name, self.hbufs[(key, kind)] if self.pos == 0 else shm.Segment(name))
        return name

    def _commit(self, write=None):
        if not self.ctl.vote(True, on_commit=write):
            raise Aborted("another rank failed during this collective")

    def _all_shapes(self, items_shapes):
        """Every rank's shape of each item: [[shape per global rank] per item]."""
        local = [[self.slots.shape(k, r) for r in self.members] for k, _ in items_shapes]
        every = self._mpi(("allgather", local if self.pos == 0 else None))
        return [[tuple(s) for h in every for s in h[i]] for i in range(len(items_shapes))]

    # ---- verbs -----------------------------------------------------------------------------
    def all_reduce(self, items, op, fence=True, scratch=False, owned=False):
        res = self._reduction(items, op, None, True, scratch)
        return [np.array(r, copy=True) for r in res] if owned else res

    def reduce(self, items, op, root, in_place=True, fence=True):
        res = self._reduction(items, op, root, in_place, False)
        return res if self.grank == root else None

    def _reduction(self, items, op, root, in_place, tentative):
        what = "all_reduce" if root is None else "reduce"
        staged, alone = [], []
        for key, arr in items:
            arr = np.asarray(arr)
            alone.append(self._alone(key, arr.dtype, op, root, in_place))
            view = self.slots.publish(key, arr, apart=alone[-1])
            staged.append((key, view.reshape(-1), view.shape))
        self.ctl.host_barrier()
        half = op in ("sum", "avg") and len(self.host_sizes) > 1     # float16: see _half_between_hosts
        kinds = []
        for (key, flat, shape), mine in zip(staged, alone):   # this host's buffers, before the
            # hosts agree: as large as the largest of the host's ranks (equal to every rank's
            # once they agree); none where MPI works on the rank's own value buffer
            if mine:
                kinds.append((flat.dtype, None, None))
                self.ctl.host_barrier()      # (the step of a host buffer's making: see _alone_between_hosts)
                continue
            count = max(int(math.prod(self.slots.shape(key, r))) for r in self.members)
            acc = None if half and flat.dtype == np.float16 else red.accumulator(op, flat.dtype)
            need = ((("r", np.float16, count), ("q", np.float16, len(self.host_sizes) * count)) if acc is None
                    else (("r", acc, count),))
            names = tuple(self._attach(key, *k) for k in need)        # (no view yet: see below)
            kinds.append((acc, need, names))
        # the hosts agree on the shapes in the request of the first exchange of data (one turn
        # through the hosts' MPI processes less): a host whose own ranks differ gives no
        # signature, and without one signature from every host no data is exchanged.  That
        # agreement is the commit (no vote): nothing any rank can see is written before it
        local = [[tuple(self.slots.shape(k, r)) for r in self.members] for k, _, _ in staged]
        same = all(len(set(shapes)) == 1 for shapes in local)
        agreement = [("agreed", tuple(shapes[0] for shapes in local) if same else None, local)]

        def exchange(req):
            if not agreement:
                return self._mpi(req)
            details, ran, result = self._mpi(agreement.pop() + (req,))
            signals.hold()     # from here on the collective is finished before an interrupt lands
            if ran:
                return result
            for i, (key, _, _) in enumerate(staged):
                shapes = [s for host in details for s in host[i]]
                if len(set(shapes)) > 1:
                    of = f" of {self.names[key]}" if key in self.names else ""
                    raise ValueError(f"{what}{of} needs the same shape on every rank, got {shapes} (by rank)")
            raise ValueError(f"{what} needs the same shapes on every rank, got {details} (by host)")
        fn = red.UFUNC[op]
        outs = []
        for (key, flat, shape), (acc, need, names), mine in zip(staged, kinds, alone):
            if mine:
                outs.append(self._alone_between_hosts(key, flat, op, exchange, tentative))
                continue
            hbufs = tuple(self._host_view(key, kind, dtype, count) for kind, dtype, count in need)
            hbuf, hname = (hbufs, names) if acc is None else (hbufs[0], names[0])
            # (a host whose ranks differ in shape adds nothing up: it only takes part in the agreement)
            srcs = [self.slots.view(key, r, flat.dtype).reshape(-1) for r in self.members] if same else None
            out = None            # in place: the source itself (read before the MPI step, written after)
            if same and (root is None or self.grank == root):
                out = (self.slots.view(key, self.slot, flat.dtype) if in_place else
                       self.slots.ensure(key, flat.dtype, shape, plane=RESULT))
            outs.append(out)
            if acc is None:
                self._half_between_hosts(op, flat, hbuf, hname, srcs, out, exchange)
                if out is not None and in_place:
                    self.slots.lend(key, tentative)
                continue
            b = chunk_bounds(flat.size, self.k, flat.dtype.itemsize)
            a0, b0 = b[self.pos], b[self.pos + 1]
            if same and b0 > a0:         # this host's sum (max, …) of my chunk
                part = hbuf[a0:b0]
                np.copyto(part, srcs[0][a0:b0], casting="unsafe")
                for s in srcs[1:]:
                    fn(part, s[a0:b0], out=part, casting="unsafe")
            self.ctl.host_barrier()
            exchange(("allreduce", hname, acc.str, flat.size, "sum" if op == "avg" else op))
            if out is not None:
                dst = out.reshape(-1)   # (the host buffer is every rank's input: read only)
                if op != "avg":
                    red.narrow_into(dst, hbuf)
                elif flat.dtype.kind in "fc":   # red.finish's scaling, straight into the result
                    with np.errstate(over="ignore"):
                        np.multiply(hbuf, hbuf.dtype.type(1.0 / self.n), out=dst, casting="unsafe")
                else:
                    red.narrow_into(dst, red.finish(op, np.array(hbuf, copy=True), self.n, flat.dtype))
                if in_place:
                    self.slots.lend(key, tentative)
        self.ctl.host_barrier()          # nobody reads the host buffers or slots any more
        return [None if out is None else out.reshape(shape) for out, (_, _, shape) in zip(outs, staged)]

    def _alone(self, key, dtype, op, root, in_place):
        """Whether the MPI all-reduce of ``key`` can work on this rank's own value buffer,
        with no host buffer and no copy in or out of it: the host's one rank, a result in
        place, accumulated in the value's own dtype, and a staging buffer that no tentative
        lend of this command may give back to its caller (the operation writes it)."""
        return (self.k == 1 and root is None and in_place and red.accumulator(op, dtype) == dtype
                and (op != "avg" or dtype.kind in "fc") and not self.slots.reverts(key))

    def _alone_between_hosts(self, key, flat, op, exchange, tentative):
        """``all_reduce`` of the host's one rank: MPI in place on its staging buffer (the
        value was copied there, apart from the one the caller keeps), which is then lent as
        the result.  A buffer that an operation given up on may still write to is retired.
        Every host counts the same steps of its control (votes between hosts compare them),
        whatever its number of ranks: this host's one rank counts, alone, the meetings its
        host would have had about a host buffer (its making, and the host's sum)."""
        self.ctl.host_barrier()
        try:
            exchange(("allreduce", self.slots.name(key), flat.dtype.str, flat.size, "sum" if op == "avg" else op))
        except BaseException:
            self.slots.retire(key)
            raise
        if op == "avg":
            with np.errstate(over="ignore"):
                np.multiply(flat, flat.dtype.type(1.0 / self.n), out=flat)
        self.slots.lend(key, tentative)
        return flat

    def _half_between_hosts(self, op, flat, bufs, names, srcs, out, exchange):
        """float16 ``sum``/``avg`` across hosts, as float16 on the wire (half the bytes of the
        float32 all-reduce the other dtypes use): each host's partial sum of a chunk (float32,
        rounded once to float16), an MPI all-gather of the hosts' partials, then every rank
        sums them in float32 in host order (``synkhronos.kernels.half``).  With one rank per host the
        result is the float32 path's; with several, each host's partial is rounded once more.
        ``exchange`` runs the MPI request (the first of a collective carries the agreement)."""
        hbuf, obuf = bufs
        count, hosts = flat.size, len(self.host_sizes)
        b = chunk_bounds(count, self.k, flat.dtype.itemsize)
        if srcs is not None and b[self.pos + 1] > b[self.pos]:
            half.reduce_into("sum", srcs, [hbuf], b[self.pos], b[self.pos + 1])
        self.ctl.host_barrier()
        exchange(("allgatherv", names[0], "<u2", [count] * hosts, names[1]))   # (MPI has no float16)
        if out is not None:
            parts = [obuf[h * count:(h + 1) * count] for h in range(hosts)]
            half.reduce_into(op, parts, [out.reshape(-1)], 0, count, scale=1.0 / self.n)

    def broadcast(self, items, root, fence=True):
        root_host, first = self._host_of(root)
        if self.grank == root:
            for key, arr, dtype in items:
                self.slots.publish(key, np.asarray(arr, dtype=dtype))
        here = self.host_index == root_host
        # the root's host's first rank reads the root's shapes after a meeting of the host;
        # every host meets alike (a command's meetings and votes are counted alike on every
        # host: one meeting more on one host would pair its votes with the wrong ones)
        if root != first:
            self.ctl.host_barrier()
        rslot = self.members[root - first] if here else None
        shapes = self._mpi(("allgather", [self.slots.shape(k, rslot) for k, _, _ in items]
                            if here and self.pos == 0 else None))[root_host]
        plans = []
        for (key, _, dtype), shape in zip(items, shapes):
            dtype = np.dtype(dtype)
            count = int(math.prod(shape))
            hbuf, hname = self._host_buffer(key, "b", dtype, count)
            mine = (self.slots.view(key, self.slot, dtype) if self.grank == root else
                    self.slots.stage(key, dtype, tuple(shape), reuse_lent=True))
            plans.append((key, dtype, tuple(shape), count, hbuf, hname, mine))
        self._commit()
        out = []
        for key, dtype, shape, count, hbuf, hname, mine in plans:
            if self.grank == root:
                np.copyto(hbuf, mine.reshape(-1))
            self.ctl.host_barrier()
            self._mpi(("bcast", hname, dtype.str, count, root_host))
            if self.grank != root:
                np.copyto(mine.reshape(-1), hbuf)
            self.slots.lend(key)
            out.append(mine.reshape(shape))
        self.ctl.host_barrier()
        return out

    def _host_of(self, grank):
        """(index of the host of global rank ``grank``, that host's first global rank)."""
        first = 0
        for h, k in enumerate(self.host_sizes):
            if grank < first + k:
                return h, first
            first += k
        raise ValueError(f"collective root {grank} is not a rank (the session has {self.n})")

    def _gather_all(self, items):
        """Every rank's array of each item, on every rank: [[array per global rank] per item]."""
        for key, arr in items:
            self.slots.publish(key, np.asarray(arr))
        self.ctl.host_barrier()
        every = self._all_shapes([(k, None) for k, _ in items])
        results = []
        for (key, arr), shapes in zip(items, every):
            dtype = np.asarray(arr).dtype
            sizes = [int(math.prod(s)) for s in shapes]
            host_counts, first = [], 0
            for k in self.host_sizes:
                host_counts.append(sum(sizes[first:first + k]))
                first += k
            hbuf, hname = self._host_buffer(key, "g", dtype, max(1, host_counts[self.host_index]))
            obuf, oname = self._host_buffer(key, "o", dtype, max(1, sum(host_counts)))
            if self.pos == 0:
                off = 0
                for r in self.members:
                    v = self.slots.view(key, r, dtype).reshape(-1)
                    hbuf[off:off + v.size] = v
                    off += v.size
            self.ctl.host_barrier()
            self._mpi(("allgatherv", hname, dtype.str, host_counts, oname))
            parts, off = [], 0
            for s, size in zip(shapes, sizes):
                parts.append(np.array(obuf[off:off + size], copy=True).reshape(s))
                off += size
            results.append(parts)
        self.ctl.host_barrier()
        return results

    def gatherv(self, items, root, fence=True):
        res = self._gather_all(items)
        return res if self.grank == root else None

    def all_gatherv(self, items, fence=True):
        out = []
        for (key, _), parts in zip(items, self._gather_all(items)):
            if parts[0].ndim == 0 or len({p.shape[1:] for p in parts}) > 1:
                of = f" of {self.names[key]}" if key in self.names else ""
                raise ValueError(f"all_gather{of} concatenates along axis 0 and needs equal trailing shapes "
                                 f"of at least 1 dimension; got {[p.shape for p in parts]} (by rank)")
            out.append(np.concatenate(parts, axis=0))
        return out

    def reduce_scatter(self, items, op, fence=True, counts=None, scratch=False):
        items = list(items)
        counts = [None] * len(items) if counts is None else list(counts)
        bounds = [row_blocks(np.shape(arr), c, self.n, self.names.get(key))     # (checked before any wait)
                  for (key, arr), c in zip(items, counts)]
        full = self._reduction(items, op, None, False, False)
        return [np.array(f[b[self.grank]:b[self.grank + 1]], copy=True) for f, b in zip(full, bounds)]

    def shapes(self, shapes):
        mine = [tuple(s) for s in shapes]
        for i, s in enumerate(mine):
            self.slots.announce(2, i, 0, s)
        self.ctl.host_barrier()
        host = [[self.slots.shape(i, r, 2) for r in self.members] for i in range(len(mine))]
        every = self._mpi(("allgather", host if self.pos == 0 else None))
        return [[tuple(s) for h in every for s in h[i]] for i in range(len(mine))]

    def barrier(self):
        self.ctl.barrier()

    def settle(self, committed):
        if self.slots is not None:          # (none before ``setup``)
            self.slots.settle(committed)
