"""The ``mpi`` control plane: a session over several machines (the same script under
``mpiexec``), shared memory inside a host, MPI between hosts.  The master's side is
``HierControl``; every worker, on every host, uses its host's ``shm`` control plane.

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
collectives (``ShmControl``, the slots of ``shm.comm``), with one extra *lead* slot through
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
  message each, on a communicator of their own (``backends.mpi.channel``).

Failure handling: a rank that exits or stops on any host is reported by its host's MPI
process and ends the master's command with WorkerDied / WorkerStopped naming the rank and
its host; a killed master takes every MPI process down (MPICH), and the workers of each
host then exit and free the host's shared memory (MPICH's own ``mpich_shm_*`` file
included); an uncaught exception in an MPI process ends the job (``MPI_Abort``) instead of
hanging it."""
import pickle
import time

import numpy as np

from .world import CMD, DATA, RESYNC
from ... import signals


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


INLINE_BYTES = 32 << 10      # a command's data up to this size travels inside its message
_STUCK_LOOK_S = 1.0          # a wait for another host's replies looks at its ranks' flights this often


class HierControl:
    """The master's control plane when the session spans several hosts: its own host's
    shared-memory session, plus MPI messages to the agents of the other hosts."""

    channel_kind = "mpi"

    def __init__(self, w, host0, hub, host_ranks, waiter, colls):
        self.w, self.local, self.hub = w, host0, hub
        self.colls = colls                        # requests.Collectives: renewed after an aborted command
        self.host_ranks = host_ranks              # MPI rank -> range of global ranks
        self.n = host_ranks[w.size - 1].stop
        self.rank = self.master_rank = 0
        self.workers = tuple(range(1, self.n))
        self.waiter = waiter
        self.remote = {r: m for m, rng in host_ranks.items() if m != 0 for r in rng}
        self._args = (None, None)                 # (the last command's arguments, their pickle)

    # master
    def send(self, seq, command, needs=()):
        # every host gets the command or none does: an interrupt (Ctrl-C) waits until all are sent
        with signals.deferred():
            self._send(seq, command, needs)

    def _send(self, seq, command, needs):
        prev = self.local.seq
        if prev > 0 and self.local.last_abort() == prev:   # (its replies are collected: it is over everywhere)
            for m in self.hub.agents:
                self.w.isend(prev, m, RESYNC)
            self.colls.renew()
        needs = needs() if callable(needs) else needs
        headers = {}
        payloads = {}
        for m in self.hub.agents:
            heads, pays = [], []
            for i, need in enumerate(needs):
                blk = host_block(need, self.host_ranks[m])
                if blk is None or need.ref.handle is None:     # (no buffer: an empty array)
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
                inline = part.tobytes() if part.nbytes <= INLINE_BYTES else None   # (one message less)
                heads.append((tuple(need.ref), kind, where, None if need.rows is None or need.rows.index is None
                              else tuple(need.rows.index), part.nbytes, inline))
                if inline is None:
                    pays.append(part)
            headers[m], payloads[m] = heads, pays
        self.local.send(seq, command)
        if command.args is not self._args[0]:     # pickled once per arguments object (a repeated plan)
            self._args = (command.args, pickle.dumps(command.args, protocol=5))
        wire = (command.name, None, command.forget, command.settle, self._args[1])
        for m in self.hub.agents:
            self.w.isend((seq, wire, headers[m]), m, CMD)
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
        look = [time.monotonic() + _STUCK_LOOK_S, {}]      # (next look, {rank: its wait's seconds})
        self.waiter.wait(lambda: all(r in got() for r in remote), self.local.sleep,
                         owed=lambda: [r for r in remote if r not in got()], what=what,
                         hopeless=lambda: self._stuck_elsewhere(seq, look))
        reps = self.hub.replies.pop(seq)
        for r in remote:
            yield r, reps[r]
        self.hub.replies = {s: v for s, v in self.hub.replies.items() if s > seq}

    def _stuck_elsewhere(self, seq, look):
        """RuntimeError when a rank of another host waits for the other hosts inside command
        ``seq`` (a collective, barrier or vote between hosts) while this host's ranks have
        all finished it: the wait can never end.  Looked at (the other hosts' flight
        records: a message each) every ``_STUCK_LOOK_S`` seconds of a wait for replies; a
        rank counts once seen in the same wait at two looks (an operation between hosts may
        end on one host a moment after the other)."""
        now = time.monotonic()
        if now < look[0] or self.local.aborted():         # (a failure: the abort ends their waits)
            return
        seen = {}
        for f in self.hub.remote_flights(0.2):
            if f.command == seq and f.waiting and (f.waiting == "a collective between hosts" or -1 in f.waiting_on):
                seen[f.rank] = f.waiting_for
                if f.waiting_for >= look[1].get(f.rank, f.waiting_for) + _STUCK_LOOK_S / 2:   # (the same wait,
                    raise RuntimeError(                                           # not the end of one)
                        f"rank {f.rank} ({f.host}) waits for {f.waiting} in this command, which every rank of "
                        "the master's host has finished: the ranks ran different numbers of collectives (a scan "
                        "or loop over a rank's own rows?); every rank must run the same collectives in the same "
                        "order")
        look[:] = [time.monotonic() + _STUCK_LOOK_S, seen]

    def peek(self, seq, rank):
        if rank in self.remote:
            return self.hub.replies.get(seq, {}).get(rank)
        return self.local.peek(seq, rank)

    def alloc(self, nbytes, tag="d", kept=True):
        return self.local.alloc(nbytes, tag, kept)

    # every rank
    def begin(self, seq):
        self.local.begin(seq)

    def abort(self, seq=None):
        self.local.abort(seq)

    def aborted(self):
        return self.local.aborted()

    def barrier(self, check_after=True):
        self.local.barrier(check_after)

    def host_barrier(self, grace=0.0):
        self.local.host_barrier(grace)

    def vote(self, ok, on_commit=None, meanwhile=None):
        return self.local.vote(ok, on_commit, meanwhile)

    def view(self, handle, dtype, shape):
        return self.local.view(handle, dtype, shape)

    def array(self, ref):
        return self.local.array(ref)

    def flight_area(self, slot):
        return self.local.flight_area(slot)

    def flights(self, wait=0.0, ranks=None, host=""):
        """Every rank's flight record: this host's read here, the others' as their agents
        last sent them (asked for now, and awaited ``wait`` seconds)."""
        mine = self.local.flights(host=host or self.w.host)
        return mine + self.hub.remote_flights(wait)

    def sleep(self, tick):
        self.local.sleep(tick)

    def wake(self, ranks):
        self.local.wake(ranks)

    def forget(self, handles):
        self.local.forget(handles)

    def close(self):
        self.local.close()

    @property
    def seq(self):
        return self.local.seq
