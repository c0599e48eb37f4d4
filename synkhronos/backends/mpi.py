"""Several machines: the same script under ``mpiexec``; shared memory inside a host, MPI
between hosts.

Topology.  One MPI process per host (``mpiexec -n HOSTS -ppn 1 ...``).  MPI rank 0 is the
master: ``synk.fork()`` returns there.  Every other MPI process is its host's *agent*:
``synk.fork()`` never returns there; the process serves the master's sessions and exits
when the master does.  On every host the ranks are worker processes started by the MPI
process of the host (the master's host: the master is rank 0 and its workers follow), so
that a rank that dies is reported by its host's MPI process, never noticed by MPI itself
(MPICH kills the whole job when one of its processes dies).  Ranks are numbered host by
host in MPI rank order.  Several MPI processes on one host (``-ppn K``) each lead their
own group of ranks; they then talk MPI to each other.

Inside a host everything is as on one machine: a shared-memory control session and
collectives (``ShmControl``, the slots of ``shm_comm``), with one extra *lead* slot through
which the other hosts take part: its barrier arrivals and votes are written by the host's
MPI process (the master on its host) once the whole session has arrived or decided.  The
master is the hub: agents forward their host's arrivals, votes, aborts, replies and lost
ranks; the master answers with "go", decisions and aborts.  Data moves between hosts only
in three ways:

* the rows each host's ranks need of a call's inputs (or of a scatter / set_value) reach
  that host once per command, into copies ("mirrors") of the master's buffers under names
  of the host's own session: ``ShmControl(mirror=True)`` resolves the master's handles to
  them;
* collectives are hierarchical (``HierComm``): each host reduces (or gathers) through
  shared memory into a host buffer, the host's MPI process runs one MPI collective on it
  with the other hosts, and every rank of the host copies the result;
* channels of asynchronous exchanges (the parameter server): each host's agent owns its
  host's channel and relays its workers' messages and the master's answers, one MPI
  message each, on a communicator of their own (``backends.mpi_channel``).

Failure handling: a rank that exits or stops on any host is reported by its host's MPI
process and ends the master's command with WorkerDied / WorkerStopped naming the rank and
its host; a killed master takes every MPI process down (MPICH), and the workers of each
host then exit and free the host's shared memory (MPICH's own ``mpich_shm_*`` file
included); an uncaught exception in an MPI process ends the job (``MPI_Abort``) instead of
hanging it."""
import json
import os
import pickle
import socket
import sys
import time

import numpy as np

from . import shm
from .shm_comm import RESULT, _chunks, _Slots
from .shm_control import ARRIVE, REPLY_SEQ, VOTE, ShmControl, mirror_name
from .. import reductions as red
from ..comm import Comm, CommStack
from ..control import Control, Waiter
from ..errors import Aborted
from ..launcher import Launcher, RankGone, SubprocessLauncher

# message tags, master <-> host agents
CMD, REPLY, ARRIVE_T, GO, VOTE_T, DECIDE, ABORT, LOST, DATA, START, READY, END, EXIT, BYE = range(101, 115)
# messages from other hosts wake no sleeper: an MPI process polls every POLL seconds while a
# command may be going on, every POLL_IDLE once nothing happened for IDLE_AFTER seconds
POLL, POLL_IDLE, IDLE_AFTER = 0.0002, 0.005, 1.0
_LOCAL_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "MPI_LOCALNRANKS")
_world = None


def launched():
    """Whether this process is one of several started by an MPI launcher."""
    for v in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        try:
            if int(os.environ.get(v, "1")) > 1:
                return True
        except ValueError:
            pass
    return False


def world():
    """MPI, initialised once per process (with what MPI_Init created in /dev/shm noted, so
    that the host can remove it if the job is killed)."""
    global _world
    if _world is None:
        _world = _World()
    return _world


class _World:
    def __init__(self):
        try:
            import mpi4py
        except ImportError:
            raise RuntimeError("synkhronos runs under mpiexec but mpi4py is missing: "
                               "pip install 'synkhronos[mpi]'") from None
        mpi4py.rc.thread_level = "serialized"
        before = set(_shm_names())
        from mpi4py import MPI
        self.MPI = MPI
        if not MPI.Is_initialized():
            MPI.Init_thread(MPI.THREAD_SERIALIZED)
        self.comm = MPI.COMM_WORLD.Dup()
        self.chan = MPI.COMM_WORLD.Dup()     # channels (backends.mpi_channel): never command traffic
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.host = MPI.Get_processor_name() or socket.gethostname()
        self.mpi_shm = sorted(set(_shm_names()) - before)        # e.g. mpich_shm_<hex>_<node>
        self.pending = []            # Isend requests still in flight (with their buffers)
        self.backlog = []
        _abort_on_uncaught(self)

    def isend(self, obj, dest, tag):
        data = pickle.dumps(obj, protocol=5)
        self.pending.append((self.comm.Isend([data, self.MPI.BYTE], dest=dest, tag=tag), data))
        self._reap()

    def isend_array(self, arr, dest, tag):
        arr = np.ascontiguousarray(arr)
        self.pending.append((self.comm.Isend([arr, self.MPI.BYTE], dest=dest, tag=tag), arr))
        self._reap()

    def _reap(self):
        if len(self.pending) > 16:
            self.pending = [(r, b) for r, b in self.pending if not r.Test()]

    def flush(self):
        for r, _ in self.pending:
            r.Wait()
        self.pending = []

    def poll(self):
        """Every control message that has arrived: [(source, tag, object)] (those put back
        with ``unread`` first)."""
        out, self.backlog = self.backlog, []
        st = self.MPI.Status()
        while self.comm.Iprobe(source=self.MPI.ANY_SOURCE, tag=self.MPI.ANY_TAG, status=st):
            if st.Get_tag() == DATA:
                break                 # array payloads are received where they are expected
            n = st.Get_count(self.MPI.BYTE)
            buf = bytearray(n)
            src, tag = st.Get_source(), st.Get_tag()
            self.comm.Recv([buf, self.MPI.BYTE], source=src, tag=tag)
            out.append((src, tag, pickle.loads(buf)))
        return out

    def unread(self, messages):
        """Messages taken by ``poll`` but not handled: the next ``poll`` returns them first."""
        self.backlog = list(messages) + self.backlog

    def recv_array(self, out, src):
        self.comm.Recv([out, self.MPI.BYTE], source=src, tag=DATA)


def _shm_names():
    try:
        return [e for e in os.listdir(shm.SHM_DIR) if e.startswith("mpich_shm_")]
    except OSError:
        return []


def _abort_on_uncaught(w):
    """An uncaught exception in an MPI process must end the job, not hang the others."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        try:
            sys.stderr.flush()
            from .. import session
            if w.rank == 0 and session._session is not None:
                session.close()           # the normal way out: agents are told to exit
                w.flush()
                return
        except BaseException:
            pass
        w.comm.Abort(1)
    sys.excepthook = hook


# ------------------------------------------------------------------------------------------
# The lead slot of a host: the master's hub logic and the agents' forwarding


class _HostView:
    """A host's shared-memory session seen by its MPI process (the lead)."""

    def __init__(self, control):
        self.ctl = control
        self.members = control.members
        self.lead = control.lead
        self.sent_arrive = self.sent_vote = 0
        self.sent_abort = -1

    def members_arrived(self):
        """The barrier token every member has reached (the smallest), 0 if none."""
        return min(self.ctl._get(r, ARRIVE) for r in self.members)

    def members_voted(self):
        """(token, all yes) when every member voted the same token; else None."""
        votes = [self.ctl._get(r, VOTE) for r in self.members]
        tok = abs(votes[0])
        if tok == 0 or any(abs(v) != tok for v in votes):
            return None
        return tok, all(v > 0 for v in votes)

    def release(self, token):
        self.ctl._set(self.lead, ARRIVE, token)
        self.ctl._post(self.members)

    def decide(self, token, ok):
        self.ctl._set(self.lead, VOTE, token if ok else -token)
        self.ctl._post(self.members)

    def local_abort(self):
        a = int(self.ctl.ctrl[1])           # ABORT_SEQ
        return a if a > self.sent_abort and a >= self.ctl.seq else None

    def set_abort(self, seq):
        self.ctl.abort(seq)


class Hub:
    """The master's side of the session between hosts (run at every poll of its waits)."""

    def __init__(self, w, host0, agents):
        self.w, self.host, self.agents = w, host0, agents
        self.arrivals = {}          # token -> set of agents
        self.votes = {}             # token -> {agent: ok}
        self.replies = {}           # seq -> {global rank: reply}
        self.lost = None
        self.ranks_info = []        # (rank, host, pid) of the other hosts' ranks

    def service(self):
        for src, tag, obj in self.w.poll():
            if tag == ARRIVE_T:
                self.arrivals.setdefault(obj, set()).add(src)
            elif tag == VOTE_T:
                tok, ok = obj
                self.votes.setdefault(tok, {})[src] = ok
            elif tag == ABORT:
                if obj >= self.host.ctl.seq:
                    self.host.set_abort(obj)
                    self.host.sent_abort = obj
                    for a in self.agents:
                        if a != src:
                            self.w.isend(obj, a, ABORT)
            elif tag == REPLY:
                seq, reps = obj
                self.replies.setdefault(seq, {}).update(reps)
            elif tag == LOST:
                if self.lost is None:
                    self.lost = obj
            elif tag == READY:          # an agent started its ranks
                host, pids = obj
                self.ranks_info.extend((r, host, p) for r, p in sorted(pids.items()))
        h = self.host
        a = h.local_abort()
        if a is not None:
            h.sent_abort = a
            for ag in self.agents:
                self.w.isend(a, ag, ABORT)
        tok = h.members_arrived()
        if tok > h.sent_arrive and self.arrivals.get(tok, set()) >= set(self.agents):
            h.sent_arrive = tok
            self.arrivals = {t: v for t, v in self.arrivals.items() if t > tok}
            for ag in self.agents:
                self.w.isend(tok, ag, GO)
            h.release(tok)
        voted = h.members_voted()
        if voted is not None and voted[0] > h.sent_vote:
            tok, ok = voted
            theirs = self.votes.get(tok, {})
            if set(theirs) >= set(self.agents):
                ok = ok and all(theirs.values())
                h.sent_vote = tok
                self.votes = {t: v for t, v in self.votes.items() if t > tok}
                for ag in self.agents:
                    self.w.isend((tok, ok), ag, DECIDE)
                h.decide(tok, ok)

    def check(self):
        if self.lost is not None:
            rank, host, rc, stopped = self.lost
            raise RankGone(rank, returncode=rc, stopped=stopped, host=host)


# ------------------------------------------------------------------------------------------
# What moves between hosts for a command: the rows each host's ranks read


def host_block(need, ranks):
    """What host ``ranks`` (a range of global ranks) need of ``need`` (a ``plans.Need``):
    ``("all", None)``, ``("rows", slice)`` (positions in the buffer) or ``("index",
    positions array)``; None when they need nothing."""
    if need.ranks is not None and not any(r in ranks for r in need.ranks):
        return None
    rows = need.rows
    if rows is None:
        return ("all", None)
    a, b = rows.bounds[ranks.start], rows.bounds[ranks.stop]
    if b <= a:
        return None
    if need.minibatch:
        off = rows.base if rows.kind == "range" else 0
        return ("rows", slice(a - off, b - off))
    if rows.kind == "range":
        return ("rows", slice(a, b))
    return ("index", (a, b))


class HierControl(Control):
    """The master's control plane when the session spans several hosts: its own host's
    shared-memory session, plus MPI messages to the agents of the other hosts."""

    def __init__(self, w, host0, hub, host_ranks, waiter):
        self.w, self.local, self.hub = w, host0, hub
        self.host_ranks = host_ranks              # MPI rank -> range of global ranks
        self.n = host_ranks[w.size - 1].stop
        self.rank = self.master_rank = 0
        self.workers = tuple(range(1, self.n))
        self.waiter = waiter
        self.remote = {r: m for m, rng in host_ranks.items() if m != 0 for r in rng}

    # master
    def send(self, seq, message, needs=()):
        needs = needs() if callable(needs) else needs
        headers = {}
        payloads = {}
        for m in self.hub.agents:
            heads, pays = [], []
            for i, need in enumerate(needs):
                blk = host_block(need, self.host_ranks[m])
                if blk is None:
                    continue
                src = self.local.array(need.ref)
                kind, where = blk
                if kind == "all":
                    part = src
                elif kind == "rows":
                    part = src[where]
                else:
                    idx = self.local.array(need.rows.index)[where[0]:where[1]]
                    part = np.take(src, idx, axis=0)
                    where = (where[0], where[1])
                heads.append((tuple(need.ref), kind, where, None if need.rows is None or need.rows.index is None
                              else tuple(need.rows.index), part.nbytes))
                pays.append(part)
            headers[m], payloads[m] = heads, pays
        self.local.send(seq, message)
        for m in self.hub.agents:
            self.w.isend((seq, message, headers[m]), m, CMD)
            for p in payloads[m]:
                self.w.isend_array(p, m, DATA)

    def committed(self):
        return self.local.committed()

    def collect(self, seq, ranks, what="command"):
        local = [r for r in ranks if r not in self.remote]
        remote = [r for r in ranks if r in self.remote]
        for item in self.local.collect(seq, local, what):
            yield item
        if not remote:
            return
        got = lambda: self.hub.replies.get(seq, {})  # noqa: E731
        self.waiter.wait(lambda: all(r in got() for r in remote), self.local._sleep,
                         owed=lambda: [r for r in remote if r not in got()], what=what)
        reps = self.hub.replies.pop(seq)
        for r in remote:
            yield r, reps[r]
        self.hub.replies = {s: v for s, v in self.hub.replies.items() if s > seq}

    def peek(self, seq, rank):
        if rank in self.remote:
            return self.hub.replies.get(seq, {}).get(rank)
        return self.local.peek(seq, rank)

    def alloc(self, nbytes, tag="d"):
        return self.local.alloc(nbytes, tag)

    def make_channel(self, ranks, up_bytes, down_bytes):
        """The channel of one command to workers on every host (``shm_channel.create``)."""
        from .mpi_channel import HostsChannel
        return HostsChannel(self, ranks, up_bytes, down_bytes)

    # every rank
    def begin(self, seq):
        self.local.begin(seq)

    def abort(self, seq=None):
        self.local.abort(seq)

    def aborted(self):
        return self.local.aborted()

    def barrier(self, check_after=True):
        self.local.barrier(check_after)

    def host_barrier(self):
        self.local.host_barrier()

    def vote(self, ok, on_commit=None, meanwhile=None):
        return self.local.vote(ok, on_commit, meanwhile)

    def view(self, handle, dtype, shape):
        return self.local.view(handle, dtype, shape)

    def forget(self, handles):
        self.local.forget(handles)

    def close(self):
        self.local.close()

    @property
    def seq(self):
        return self.local.seq


class MpiLauncher(Launcher):
    """The master's launcher: its own host's workers, and the other hosts' ranks through
    their agents' reports."""

    def __init__(self, local, hub, remote_info):
        self.local, self.hub, self.remote_info = local, hub, remote_info
        self.host = socket.gethostname()

    def start(self, ranks, argv, env_for):
        self.local.start(ranks, argv, env_for)

    def check(self):
        self.hub.service()
        self.hub.check()
        self.local.check()

    def info(self):
        return self.local.info() + list(self.hub.ranks_info)

    def stop(self, graceful=True):
        self.local.stop(graceful)


# ------------------------------------------------------------------------------------------
# Hierarchical collectives (every rank of every host)


class _Requests:
    """A host's requests to its MPI process, and the host buffers they work on.

    The first rank of the host writes a request (one MPI operation on a host buffer) and
    waits; the host's MPI process runs it with the other hosts (the same operations in the
    same order everywhere) and answers.  The master runs its own host's requests itself."""

    _AREA = 1 << 18            # request, then two answer areas used in turn (by token parity:
                               # a rank may still read one while the next is being written)

    def __init__(self, prefix, create):
        self.seg = shm.Segment(prefix + "_req", 3 * self._AREA, create=create)
        self.head = np.ndarray((4,), np.int64, self.seg.mm)           # request: length, token

    def write(self, token, req):
        data = pickle.dumps(req, protocol=5)
        self.seg.mm[64:64 + len(data)] = data
        self.head[0] = len(data)
        self.head[1] = token

    def pending(self, done):
        """(token, request) of a request newer than ``done``, else None."""
        token = int(self.head[1])
        if token <= done:
            return None
        return token, pickle.loads(self.seg.mm[64:64 + int(self.head[0])])

    def _area(self, token):
        off = self._AREA * (1 + token % 2)
        return off, np.ndarray((4,), np.int64, self.seg.mm, offset=off)

    def answer(self, token, obj):
        data = pickle.dumps(obj, protocol=5)
        off, head = self._area(token)
        if len(data) > self._AREA - 64:
            raise ValueError("an answer between hosts is too large")
        self.seg.mm[off + 64:off + 64 + len(data)] = data
        head[0] = len(data)
        head[1] = token

    def answered(self, token):
        return int(self._area(token)[1][1]) == token

    def answer_obj(self, token):
        off, head = self._area(token)
        return pickle.loads(self.seg.mm[off + 64:off + 64 + int(head[0])])

    def close(self):
        self.seg = None


def run_request(w, req, buffers):
    """Run one request of a host between hosts (every host's MPI process, in order).
    ``buffers``: name -> Segment cache of the host's buffers."""
    kind = req[0]
    MPI = w.MPI
    if kind == "allgather":
        return w.comm.allgather(req[1])

    def arr(name, dtype, count):
        seg = buffers.get(name)
        if seg is None:
            # host buffers are named PREFIX_h{kind}{key}x{n}: a new n replaced the old buffer
            stem = name[:name.rindex("x")]
            for old in [b for b in buffers if b[:b.rindex("x")] == stem]:
                del buffers[old]                 # unmap it: its memory goes back
            seg = buffers[name] = shm.Segment(name)
        return seg.array(np.dtype(dtype), (count,))
    if kind == "allreduce":
        _, name, dtype, count, op = req
        op = {"sum": MPI.SUM, "prod": MPI.PROD, "max": MPI.MAX, "min": MPI.MIN}[op]
        w.comm.Allreduce(MPI.IN_PLACE, arr(name, dtype, count), op=op)
    elif kind == "bcast":
        _, name, dtype, count = req
        w.comm.Bcast(arr(name, dtype, count), root=0)
    elif kind == "allgatherv":
        _, name, dtype, counts, out_name = req
        out = arr(out_name, dtype, max(1, sum(counts)))
        displ = [int(x) for x in np.concatenate([[0], np.cumsum(counts)[:-1]])]
        w.comm.Allgatherv(arr(name, dtype, max(1, counts[w.rank]))[:counts[w.rank]],
                          [out, (list(counts), displ)])
    else:
        raise ValueError(f"unknown request {kind!r}")
    return None


class HierComm(Comm):
    """Collectives of a session spanning several hosts, as every rank runs them: shared
    memory among the ranks of a host, one MPI collective between hosts on a host buffer
    (run by the host's MPI process), shared memory again to give every rank the result.
    Nothing any rank can see changes before every rank of every host voted yes."""

    name = "hier"
    returns_new = ("all_gatherv", "reduce_scatter", "gatherv")   # verbs whose results are new arrays

    def __init__(self, prefix, slot, control, create, host_index, host_sizes, grank, w=None):
        self.prefix, self.slot, self.ctl = prefix, slot, control
        self.members = control.members
        self.pos = self.members.index(slot)            # my place among the host's ranks
        self.k = len(self.members)
        self.create, self.w = create, w                # w: MPI (the master only)
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

    def accepts(self, verb, dtype, op=None, placement="host"):
        return placement == "host"

    def setup(self, n_keys, names=None):
        self.names = dict(names or {})
        if self.slots is None:
            self.slots = _Slots(self.prefix, self.slot, self.ctl.n, max(64, n_keys), self.create)
            self.requests = _Requests(self.prefix, self.create)

    def close(self):
        for seg in self.hbufs.values():
            seg.unlink()
        self.hbufs.clear()

    # ---- helpers ---------------------------------------------------------------------------
    def _token(self):
        if self.ctl.seq != self.step_seq:           # a new command: its steps count from 1
            self.step_seq, self.steps = self.ctl.seq, 0
        self.steps += 1
        return self.ctl.seq * 4096 + self.steps

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
            if self.w is not None:
                self.requests.answer(token, run_request(self.w, req, self.mpi_buffers))
            else:
                self.requests.write(token, req)
                self.ctl.waiter.wait(lambda: self.requests.answered(token), self.ctl._sleep,
                                     owed=lambda: [], what="a collective between hosts")
        self.ctl.host_barrier()
        return self.requests.answer_obj(token)

    def _host_buffer(self, key, kind, dtype, count):
        """A buffer of the host (owned by its first rank) for ``key``: every rank's view."""
        dtype = np.dtype(dtype)
        nbytes = max(64, count * dtype.itemsize)
        name = None
        if self.pos == 0:
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
            cur = self.attached[(key, kind)] = (name, self.hbufs[(key, kind)] if self.pos == 0 else shm.Segment(name))
        return cur[1].array(dtype, (count,)), name

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
        res = self._reduction(items, op, None, True)
        return [np.array(r, copy=True) for r in res] if owned else res

    def reduce(self, items, op, root, in_place=True, fence=True):
        res = self._reduction(items, op, root, in_place)
        return res if self.grank == root else None

    def _reduction(self, items, op, root, in_place):
        what = "all_reduce" if root is None else "reduce"
        staged = []
        for key, arr in items:
            view = self.slots.publish(key, np.asarray(arr))
            staged.append((key, view.reshape(-1), view.shape))
        self.ctl.host_barrier()
        every = self._all_shapes([(k, s) for k, _, s in staged])
        for (key, _, _), shapes in zip(staged, every):
            if len(set(shapes)) > 1:
                of = f" of {self.names[key]}" if key in self.names else ""
                raise ValueError(f"{what}{of} needs the same shape on every rank, got {shapes} (by rank)")
        plans = []
        for key, flat, shape in staged:
            acc = red.accumulator(op, flat.dtype)
            if flat.dtype == np.float16 and op in ("sum", "avg") and len(self.host_sizes) > 1:
                acc = None                # float16 between hosts: see _half_between_hosts
                (h, hn), (q, qn) = (self._host_buffer(key, "r", np.float16, flat.size),
                                    self._host_buffer(key, "q", np.float16, len(self.host_sizes) * flat.size))
                hbuf, hname = (h, q), (hn, qn)
            else:
                hbuf, hname = self._host_buffer(key, "r", acc, flat.size)
            srcs = [self.slots.view(key, r, flat.dtype).reshape(-1) for r in self.members]
            out = None            # in place: the source itself (read before the MPI step, written after)
            if root is None or self.grank == root:
                out = (self.slots.view(key, self.slot, flat.dtype) if in_place else
                       self.slots.ensure(key, flat.dtype, shape, plane=RESULT))
            plans.append((key, flat, shape, acc, hbuf, hname, srcs, out))
        self._commit()                  # every rank of every host is ready: now compute
        fn = red.UFUNC[op]
        for key, flat, shape, acc, hbuf, hname, srcs, out in plans:
            if acc is None:
                self._half_between_hosts(op, flat, hbuf, hname, srcs, out)
                if out is not None and in_place:
                    self.slots.lend(key)
                continue
            b = _chunks(flat.size, self.k, flat.dtype.itemsize)
            a0, b0 = b[self.pos], b[self.pos + 1]
            if b0 > a0:                  # this host's sum (max, …) of my chunk
                part = hbuf[a0:b0]
                np.copyto(part, srcs[0][a0:b0], casting="unsafe")
                for s in srcs[1:]:
                    fn(part, s[a0:b0], out=part, casting="unsafe")
            self.ctl.host_barrier()
            self._mpi(("allreduce", hname, acc.str, flat.size, "sum" if op == "avg" else op))
            if out is not None:
                dst = out.reshape(-1)   # (the host buffer is every rank's input: read only)
                if op != "avg":
                    np.copyto(dst, hbuf, casting="unsafe")
                elif flat.dtype.kind in "fc":   # red.finish's scaling, straight into the result
                    np.multiply(hbuf, hbuf.dtype.type(1.0 / self.n), out=dst, casting="unsafe")
                else:
                    np.copyto(dst, red.finish(op, np.array(hbuf, copy=True), self.n, flat.dtype),
                              casting="unsafe")
                if in_place:
                    self.slots.lend(key)
        self.ctl.host_barrier()          # nobody reads the host buffers or slots any more
        return [None if p[7] is None else p[7].reshape(p[2]) for p in plans]

    def _half_between_hosts(self, op, flat, bufs, names, srcs, out):
        """float16 ``sum``/``avg`` across hosts, as float16 on the wire (half the bytes of the
        float32 all-reduce the other dtypes use): each host's partial sum of a chunk (float32,
        rounded once to float16), an MPI all-gather of the hosts' partials, then every rank
        sums them in float32 in host order (``backends.half``).  With one rank per host the
        result is the float32 path's; with several, each host's partial is rounded once more."""
        from . import half
        hbuf, obuf = bufs
        count, hosts = flat.size, len(self.host_sizes)
        b = _chunks(count, self.k, flat.dtype.itemsize)
        if b[self.pos + 1] > b[self.pos]:
            half.reduce_into("sum", srcs, [hbuf], b[self.pos], b[self.pos + 1])
        self.ctl.host_barrier()
        self._mpi(("allgatherv", names[0], "<u2", [count] * hosts, names[1]))   # (MPI has no float16)
        if out is not None:
            parts = [obuf[h * count:(h + 1) * count] for h in range(hosts)]
            half.reduce_into(op, parts, [out.reshape(-1)], 0, count, scale=1.0 / self.n)

    def broadcast(self, items, root, fence=True):
        if root != 0:
            raise ValueError("between hosts, broadcast comes from the master (rank 0)")
        if self.grank == 0:
            for key, arr, dtype in items:
                self.slots.publish(key, np.asarray(arr, dtype=dtype))
        shapes = self._mpi(("allgather", [self.slots.shape(k, self.slot) for k, _, _ in items]
                            if self.grank == 0 else None))[0]
        plans = []
        for (key, _, dtype), shape in zip(items, shapes):
            dtype = np.dtype(dtype)
            count = int(np.prod(shape))
            hbuf, hname = self._host_buffer(key, "b", dtype, count)
            mine = (self.slots.view(key, self.slot, dtype) if self.grank == 0 else
                    self.slots.stage(key, dtype, tuple(shape), reuse_lent=True))
            plans.append((key, dtype, tuple(shape), count, hbuf, hname, mine))
        self._commit()
        out = []
        for key, dtype, shape, count, hbuf, hname, mine in plans:
            if self.grank == 0:
                np.copyto(hbuf, mine.reshape(-1))
            self.ctl.host_barrier()
            self._mpi(("bcast", hname, dtype.str, count))
            if self.grank != 0:
                np.copyto(mine.reshape(-1), hbuf)
            self.slots.lend(key)
            out.append(mine.reshape(shape))
        self.ctl.host_barrier()
        return out

    def _gather_all(self, items):
        """Every rank's array of each item, on every rank: [[array per global rank] per item]."""
        for key, arr in items:
            self.slots.publish(key, np.asarray(arr))
        self.ctl.host_barrier()
        every = self._all_shapes([(k, None) for k, _ in items])
        results = []
        for (key, arr), shapes in zip(items, every):
            dtype = np.asarray(arr).dtype
            sizes = [int(np.prod(s)) for s in shapes]
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

    def reduce_scatter(self, items, op, fence=True, counts=None):
        full = self._reduction(list(items), op, None, False)
        out = []
        for f in full:
            rows = f.shape[0]
            b = [(r * rows) // self.n for r in range(self.n + 1)] if counts is None else \
                [0] + [int(c) for c in np.cumsum(counts)]
            out.append(np.array(f[b[self.grank]:b[self.grank + 1]], copy=True))
        return out

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


# ------------------------------------------------------------------------------------------
# The sessions: the master's planes, the workers' planes, and the agents


def plan_hosts(n_parallel):
    """The master learns every MPI process's host and cores (each agent says so when it
    starts) and decides how many ranks each host gets: its usable cores, or ``n_parallel``
    split over the hosts.  Returns (ranks per MPI process, [(host, pid)] per MPI process)."""
    w = world()
    from ..device import usable_cores
    info = {0: (w.host, usable_cores(), os.getpid())}
    deadline = time.monotonic() + 120
    while len(info) < w.size:
        for src, tag, obj in w.poll():
            if tag == READY:
                info[src] = obj
        if time.monotonic() > deadline:
            raise RuntimeError(f"synkhronos: MPI processes {sorted(set(range(w.size)) - set(info))} did not "
                               "report (did every process of the job call synk.fork()?)")
        time.sleep(0.001)
    if n_parallel is None:
        sizes = [info[m][1] for m in range(w.size)]
    else:
        if n_parallel < w.size:
            raise ValueError(f"n_parallel={n_parallel} is less than the {w.size} MPI processes (one "
                             "per host): every host needs at least one rank")
        sizes = [n_parallel // w.size + (1 if m < n_parallel % w.size else 0) for m in range(w.size)]
    return sizes, [(info[m][0], info[m][2]) for m in range(w.size)]


def _worker_cfg(prefix, slots, slot, members, lead, mirror, host_index, sizes, grank, master_pid, mpi_shm):
    return dict(backend="mpi", prefix=prefix, slots=slots, slot=slot, members=list(members), lead=lead,
                mirror=mirror, host_index=host_index, host_sizes=list(sizes), rank=grank,
                master_pid=master_pid, mpi_shm=list(mpi_shm))


class _Mpi:
    """The backend of a session that spans several hosts (started by mpiexec)."""

    name = "mpi"

    @staticmethod
    def create(session):
        from . import Planes
        w = world()
        sizes, hosts = session.mpi_hosts
        agents = list(range(1, w.size))
        firsts = [sum(sizes[:m]) for m in range(w.size)]
        host_ranks = {m: range(firsts[m], firsts[m] + sizes[m]) for m in range(w.size)}
        k0 = sizes[0]
        prefix = shm.new_prefix()
        session.waiter.TICK = POLL          # messages from other hosts do not wake a sleeper
        ctl0 = ShmControl(prefix, k0 + 1, 0, 0, session.waiter, create=True, members=range(k0), lead=k0)
        hub = Hub(w, _HostView(ctl0), agents)
        session.waiter.service = hub.service
        control = HierControl(w, ctl0, hub, host_ranks, session.waiter)
        comm = CommStack([HierComm(prefix, 0, ctl0, True, 0, sizes, 0, w=w)])
        launcher = MpiLauncher(SubprocessLauncher(), hub, [])
        base = dict(n=session.n, master_rank=0, sys_path=[p for p in sys.path if p],
                    profile=session.profile_workers, debug=session.debug, spin=session.waiter.spin)
        for m in agents:
            dev = session.device.config()
            dev["local_n"] = sizes[m]
            w.isend(dict(base, device=dev, host_index=m, host_sizes=sizes, first=firsts[m]), m, START)

        def worker_config(r):
            return _worker_cfg(prefix, k0 + 1, r, range(k0), k0, False, 0, sizes, r, os.getpid(), w.mpi_shm)
        hub.hosts = hosts
        return Planes(control, comm, {}, {"shm_prefix": prefix, "hosts": [h for h, _ in hosts]},
                      launcher=launcher, local_workers=tuple(range(1, k0)), rank_config=worker_config)

    @staticmethod
    def attach(cfg, rank, waiter):
        control = ShmControl(cfg["prefix"], cfg["slots"], cfg["slot"], 0, waiter, create=False,
                             members=cfg["members"], lead=cfg["lead"], mirror=cfg["mirror"])
        comm = CommStack([HierComm(cfg["prefix"], cfg["slot"], control, False, cfg["host_index"],
                                   cfg["host_sizes"], cfg["rank"])])
        return control, comm

    @staticmethod
    def remove(session):
        info = getattr(session, "info", None)
        if info is not None:
            shm.remove_all(info.resources["shm_prefix"])
        w = world()
        for m in range(1, w.size):
            w.isend(not session.closed_cleanly, m, END)
        w.flush()

    @staticmethod
    def worker_exit(cfg):
        """A worker whose host's MPI process is gone frees the host's shared memory (MPICH's
        own file included: MPICH was killed with the job and cannot)."""
        shm.remove_all(cfg["prefix"])
        for name in cfg.get("mpi_shm", ()):
            try:
                os.unlink(os.path.join(shm.SHM_DIR, name))
            except OSError:
                pass

    @staticmethod
    def reap():
        return 0


mpi_backend = _Mpi()


def finish():
    """The master process exits: its session closes, then every agent exits (at exit)."""
    if _world is not None and _world.rank == 0 and not getattr(_world, "finished", False):
        _world.finished = True
        from .. import session
        session.close()
        for m in range(1, _world.size):
            _world.isend(None, m, EXIT)
        _world.flush()
        # a message only sent may still be lost when its sender finalizes and exits: wait
        # (a while) until every agent says it got it
        waiting, deadline = set(range(1, _world.size)), time.monotonic() + 10.0
        while waiting and time.monotonic() < deadline:
            for src, tag, _ in _world.poll():
                if tag == BYE:
                    waiting.discard(src)
            time.sleep(0.001)


_hosts_seen = None


def hosts(n_parallel):
    """``plan_hosts`` once per job (agents report once)."""
    global _hosts_seen
    if _hosts_seen is None:
        _hosts_seen = plan_hosts(None)
    sizes, where = _hosts_seen
    if n_parallel is not None:
        w = world()
        if n_parallel < w.size:
            raise ValueError(f"n_parallel={n_parallel} is less than the {w.size} MPI processes (one "
                             "per host): every host needs at least one rank")
        sizes = [n_parallel // w.size + (1 if m < n_parallel % w.size else 0) for m in range(w.size)]
    return sizes, where


def serve_host():
    """The life of an MPI process other than the master: say which host it is on, then
    serve the master's sessions until the master exits.  Never returns."""
    w = world()
    from ..device import usable_cores
    w.isend((w.host, usable_cores(), os.getpid()), 0, READY)
    try:
        while True:
            src, tag, obj = _next(w, (START, EXIT))
            if tag == EXIT or _Agent(w, obj).run() == "exit":
                break
    finally:
        w.isend(None, 0, BYE)
        w.flush()
    sys.exit(0)


def _next(w, tags):
    """The next message with one of ``tags`` (others are dropped), polling."""
    while True:
        messages = w.poll()
        for i, (src, tag, obj) in enumerate(messages):
            if tag in tags:
                w.unread(messages[i + 1:])
                return src, tag, obj
        time.sleep(0.002)


class _Agent:
    """One session on a host other than the master's: its workers, its shared memory, and
    the messages between them and the master."""

    def __init__(self, w, cfg):
        self.w, self.cfg = w, cfg
        self.k = k = cfg["device"]["local_n"]
        self.first = cfg["first"]
        self.prefix = shm.new_prefix()
        self.members = tuple(range(1, k + 1))
        self.waiter = Waiter(lambda: None, None, None, spin=cfg.get("spin"))
        self.ctl = ShmControl(self.prefix, k + 1, 0, 0, self.waiter, create=True, members=self.members,
                              lead=0, mirror=True)
        self.host = _HostView(self.ctl)
        self.requests = _Requests(self.prefix, True)
        self.launcher = SubprocessLauncher()
        self.mirrors = {}              # master's handle -> Segment (its copy on this host)
        self.buffers = {}              # host buffers attached for MPI requests
        self.inflight = None
        self.relay = None              # the host's end of channels (mpi_channel.HostRelay)
        self.replied = -1              # the last command every rank of the host answered
        self.req_done = 0
        self.lost_sent = False

    def grank(self, slot):
        return self.first + slot - 1

    def slot(self, grank):
        return grank - self.first + 1

    def start(self):
        cfg = self.cfg
        pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from ..device import make_device
        from ..launcher import clean_env
        device = make_device(cfg["device"], cfg["n"])

        def env_for(r):
            wc = dict(cfg, **_worker_cfg(self.prefix, self.k + 1, self.slot(r), self.members, 0, True,
                                         cfg["host_index"], cfg["host_sizes"], r, os.getpid(), self.w.mpi_shm))
            wc.pop("first", None)
            env = clean_env(dict(os.environ))
            env.update(device.worker_env(r))
            env["SYNK_WORKER_CONFIG"] = json.dumps(wc)
            env["PYTHONPATH"] = os.pathsep.join([pkg_parent] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
            return env
        ranks = [self.grank(s) for s in self.members]
        self.launcher.start(ranks, lambda r: [sys.executable, "-P", "-m", "synkhronos.worker",
                                              json.dumps({"rank": r})], env_for)
        self.inflight = 0
        pids = {r: p for r, _h, p in self.launcher.info()}
        from .mpi_channel import HostRelay
        self.relay = HostRelay(self.w, self.ctl, self.first, pids)
        self.w.isend((self.w.host, pids), 0, READY)

    def run(self):
        try:
            self.start()
            quiet_since = None
            while True:
                busy = self.step()
                if busy is None:
                    return self.ended
                if busy:
                    quiet_since = None
                    continue
                now = time.perf_counter()
                if quiet_since is None:
                    quiet_since = now
                quiet = now - quiet_since
                if quiet > self.waiter.spin:     # sleep until a rank of this host posts, or a
                    # tick passes (MPI messages wake nobody): short while a command may be
                    # going on, longer once the session has been idle for a while
                    self.ctl._sleep(POLL if quiet < IDLE_AFTER else POLL_IDLE)
        finally:
            self.stop()

    def step(self):
        """One round of everything the agent watches; None once the session ended."""
        w, host, ctl = self.w, self.host, self.ctl
        busy = self.relay.service(self.replied)     # channels first: a run opens before its command
        messages = w.poll()
        for i, (_src, tag, obj) in enumerate(messages):
            busy = True
            if tag == CMD:
                self.command(*obj)
            elif tag == GO:
                host.release(obj)
            elif tag == DECIDE:
                host.decide(*obj)
            elif tag == ABORT:
                if obj >= ctl.seq:
                    host.sent_abort = obj
                    host.set_abort(obj)
            elif tag in (END, EXIT):
                self.graceful = not obj if tag == END else False
                self.ended = "end" if tag == END else "exit"
                w.unread(messages[i + 1:])
                return None
        tok = host.members_arrived()
        if tok > host.sent_arrive:
            host.sent_arrive = tok
            w.isend(tok, 0, ARRIVE_T)
            busy = True
        voted = host.members_voted()
        if voted is not None and voted[0] > host.sent_vote:
            host.sent_vote = voted[0]
            w.isend(voted, 0, VOTE_T)
            busy = True
        a = host.local_abort()
        if a is not None:
            host.sent_abort = a
            w.isend(a, 0, ABORT)
            busy = True
        req = self.requests.pending(self.req_done)
        if req is not None:
            token, r = req
            self.requests.answer(token, run_request(w, r, self.buffers))
            self.req_done = token
            ctl._post(self.members)
            busy = True
        if self.inflight is not None and all(ctl._get(m, REPLY_SEQ) == self.inflight for m in self.members):
            seq = self.inflight
            w.isend((seq, {self.grank(m): ctl.reply_of(m, seq) for m in self.members}), 0, REPLY)
            self.inflight = None
            self.replied = seq
            busy = True
        if not self.lost_sent:
            try:
                self.launcher.check()
            except RankGone as g:
                self.lost_sent = True
                w.isend((g.rank, w.host, g.returncode, g.stopped), 0, LOST)
        return busy

    def command(self, seq, message, heads):
        """A command from the master: take the data it needs into this host's copies of the
        master's buffers, drop the copies the master released, hand it to the ranks."""
        for handle in message[2]:                     # the master's released buffers
            seg = self.mirrors.pop(handle, None)
            if seg is not None:
                seg.unlink()
        for ref, kind, where, idx_ref, nbytes in heads:
            arr = self.mirror(ref)
            if kind == "all":
                self.w.recv_array(arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8), 0)
            elif kind == "rows":
                self.w.recv_array(arr[where], 0)
            else:
                part = np.empty((nbytes // max(1, arr.dtype.itemsize * int(np.prod(arr.shape[1:])) or 1),)
                                + arr.shape[1:], arr.dtype)
                self.w.recv_array(part, 0)
                positions = self.mirror(idx_ref)[where[0]:where[1]]
                arr[positions] = part
        if message[0] == "distribute":                # the ranks attach to the slot table
            self.table = _Slots(self.prefix, 0, self.k + 1, max(64, message[1][1]), True)
        self.ctl.send(seq, message)
        self.inflight = seq

    def mirror(self, ref):
        handle, dtype, shape = ref
        dtype = np.dtype(dtype)
        nbytes = max(64, int(np.prod(shape)) * dtype.itemsize)
        seg = self.mirrors.get(handle)
        if seg is None or seg.size < nbytes:
            if seg is not None:
                seg.unlink()
            shm.check_space(nbytes)
            seg = self.mirrors[handle] = shm.Segment(mirror_name(self.prefix, handle), nbytes, create=True)
        return seg.array(dtype, tuple(shape))

    def stop(self):
        if self.relay is not None:
            self.relay.abandon()
        self.launcher.stop(getattr(self, "graceful", False))
        self.ctl.close()
        shm.remove_all(self.prefix)
