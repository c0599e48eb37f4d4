"""Channels across hosts (``mpiexec``): the parameter server's asynchronous exchange when
the session spans several hosts.

Inside each host nothing changes: the workers of a host attach the ``shm.channel.Channel``
of their host (``Channel.attach(control, token, rank)``), send into their up areas and
wait for answers in their down areas, exactly as on one host.  The channel of the
master's host is the master's; the channel of every other host is owned by the host's
agent (``HostRelay``, run at every step of ``backends.mpi.agent.Agent``), which relays:

* a worker's message (``HEAD`` bytes of metadata, then the gradient) goes to the master as
  ONE MPI message sent straight from the worker's up area; the master receives it into a
  buffer of that worker (``HostsChannel.up``);
* the master's answer (metadata, then the weights) goes back as one message received
  straight into the worker's down area; then the agent publishes it to the worker.

So a gradient crosses hosts once per push and the weights once per answer, as raw bytes
(no pickling).  The master's ``HostsChannel`` has the interface of ``Channel`` (pending,
message, up, down, answer, status, wait_any, stop, close): the server that uses it does
not know where its workers are.

Messages use their own communicator (``_World.chan``, a duplicate of the world's), so they
can never be taken for commands: tag ``DATA + rank`` for one worker's messages (each way),
``CTRL_DOWN`` (open, close: master to agent) and ``CTRL_UP`` (status, closed: agent to
master), small pickled tuples carrying the run's token.

* **open**: sent with the master's first answer of a run (so a run whose command never
  started leaves nothing on the other hosts); the agent makes its host's channel (its
  workers wait for the segment until then), posts a receive per worker for the master's
  answers, and reports its workers' states (``Channel.status``: alive, dead, stopped,
  failed, finished; a change within ``STATUS_EVERY`` seconds) with ``status`` messages;
* **close** (the master stops the run): carries how many answers the master sent each
  worker; the agent tells its workers to stop, receives exactly those answers, cancels
  what remains posted and replies ``closed`` with how many messages it forwarded per
  worker, which the master then receives (and drops).  Nothing of a run stays in flight
  afterwards, so a later run cannot receive an earlier run's messages (each message also
  names its run, and one that does not is dropped).  The master waits at most ``DRAIN``
  seconds; the agent removes the host's segment once its workers have answered the command.

Every wait polls (MPI messages wake nobody) every ``POLL`` seconds and is bounded; the
master's polls also serve the session's hub (aborts, replies and lost ranks of other
hosts), as its waits do.  Requests that could not complete (the other side gone) are kept
with their buffers in ``_orphans``, never waited for."""
import pickle
import sys
import time

import numpy as np

from ..shm.channel import HEAD, Channel
from ... import signals

CTRL_DOWN, CTRL_UP = 1, 2           # tags on the channel communicator
DATA = 16                           # + the worker's rank: its messages, both ways
POLL = 0.0002
STATUS_EVERY = 0.05
DRAIN = 10.0
_orphans = []                       # (request, buffer) that MPI may still use: kept alive


def _run_id(token):
    return int(token[:15], 16)


def _orphan(req, buf):
    """Keep ``buf`` alive while ``req`` is not complete (never waits)."""
    _orphans[:] = [(r, b) for r, b in _orphans if not r.Test()]
    if not req.Test():
        _orphans.append((req, buf))


def _cancel(req):
    """Cancel a posted receive; True when it had received a message first."""
    if req.Test():
        return True
    req.Cancel()
    st = _mpi().Status()
    req.Wait(st)                     # a cancelled request completes locally
    return not st.Is_cancelled()


def _mpi():
    from mpi4py import MPI
    return MPI


def _recv_obj(comm, st):
    """Receive the message ``st`` describes (after a probe): a pickled object."""
    MPI = _mpi()
    buf = bytearray(st.Get_count(MPI.BYTE))
    comm.Recv([buf, MPI.BYTE], source=st.Get_source(), tag=st.Get_tag())
    return pickle.loads(buf)


class _Control:
    """Small pickled messages of one process on the channel communicator."""

    def __init__(self, comm):
        self.comm, self.sends = comm, []

    def send(self, obj, dest, tag):
        data = pickle.dumps(obj, protocol=5)
        self.sends.append((self.comm.Isend([data, _mpi().BYTE], dest=dest, tag=tag), data))
        self.sends = [(r, b) for r, b in self.sends if not r.Test()]

    def finish(self):
        for r, b in self.sends:
            _orphan(r, b)
        self.sends = []


# ------------------------------------------------------------------------------------------
# the master


class HostsChannel:
    """The master's channel to the workers of every host (``HierControl.make_channel``)."""

    def __init__(self, control, ranks, up_bytes, down_bytes):
        self.control = control                    # HierControl: aborted(), the hub
        self.comm = control.w.chan
        self.ranks = tuple(int(r) for r in ranks)
        self.up_bytes, self.down_bytes = int(up_bytes), int(down_bytes)
        self.host_of = {r: control.remote[r] for r in self.ranks if r in control.remote}
        self.local = Channel.create(control.local, [r for r in self.ranks if r not in self.host_of],
                                    up_bytes, down_bytes)
        self.token = self.local.token
        self.name = self.local.name
        self.id = _run_id(self.token)
        self.agents = {}
        for r, m in self.host_of.items():
            self.agents.setdefault(m, []).append(r)
        self.up_buf = {r: np.zeros(HEAD + self.up_bytes, np.uint8) for r in self.host_of}
        self.down_buf = {r: np.zeros(HEAD + self.down_bytes, np.uint8) for r in self.host_of}
        self.recv = {}                            # rank -> receive of its next message
        self.sends = {}                           # rank -> the last answer sent
        self.have = {}                            # rank -> metadata of its unanswered message
        self.n_up = {r: 0 for r in self.host_of}
        self.n_down = {r: 0 for r in self.host_of}
        self.remote_status = {r: "starting" for r in self.host_of}
        self.closed = {}                          # agent -> {rank: messages it forwarded}
        self.ctrl = _Control(self.comm)
        self.opened = self.stopped = False

    # ---- the run ------------------------------------------------------------------------------
    def _open(self):
        if self.opened or not self.agents:
            return
        MPI = _mpi()
        with signals.deferred():              # every agent opens, or none
            self.opened = True
            for m, rs in self.agents.items():     # (the run's command: its replies free the segment)
                self.ctrl.send(("open", self.token, rs, self.up_bytes, self.down_bytes, self.control.seq), m,
                               CTRL_DOWN)
            for r, m in self.host_of.items():
                self.recv[r] = self.comm.Irecv([self.up_buf[r], MPI.BYTE], source=m, tag=DATA + r)

    def _service(self):
        """Serve the session's hub, take the messages that arrived."""
        self.control.hub.service()
        if not self.opened:
            return
        MPI = _mpi()
        with signals.deferred():              # a count and its message go together
            for r, req in self.recv.items():
                if req is None or not req.Test():
                    continue
                self.recv[r] = None
                head = self.up_buf[r][:HEAD].view(np.int64)
                if int(head[0]) != self.id:   # not this run's: dropped
                    self.recv[r] = self.comm.Irecv([self.up_buf[r], MPI.BYTE], source=self.host_of[r],
                                                   tag=DATA + r)
                    continue
                self.n_up[r] += 1
                if not self.stopped:
                    self.have[r] = tuple(int(x) for x in head[2:6])
            st = MPI.Status()
            while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=CTRL_UP, status=st):
                src = st.Get_source()
                kind, token, body = _recv_obj(self.comm, st)
                if token != self.token:
                    continue
                if kind == "status":
                    self.remote_status.update(body)
                elif kind == "closed":
                    self.closed[src] = body

    def pending(self):
        self._service()
        return self.local.pending() + [r for r in self.ranks if r in self.have]

    def message(self, rank):
        if rank in self.host_of:
            return self.have[rank]
        return self.local.message(rank)

    def up(self, rank, dtype=np.uint8, count=None):
        if rank not in self.host_of:
            return self.local.up(rank, dtype, count)
        dtype = np.dtype(dtype)
        count = self.up_bytes // dtype.itemsize if count is None else count
        return self.up_buf[rank][HEAD:HEAD + count * dtype.itemsize].view(dtype)

    def down(self, rank, dtype=np.uint8, count=None):
        """``rank``'s down area (across hosts: the master's buffer of its next answer)."""
        if rank not in self.host_of:
            return self.local.down(rank, dtype, count)
        prev = self.sends.pop(rank, None)
        if prev is not None and not self._complete([prev], DRAIN):
            _orphan(prev, self.down_buf[rank])       # (its host is gone: a fresh buffer)
            self.down_buf[rank] = np.zeros(HEAD + self.down_bytes, np.uint8)
        dtype = np.dtype(dtype)
        count = self.down_bytes // dtype.itemsize if count is None else count
        return self.down_buf[rank][HEAD:HEAD + count * dtype.itemsize].view(dtype)

    def answer(self, rank, meta=(), consumed=True):
        if rank not in self.host_of:
            return self.local.answer(rank, meta, consumed)
        self._open()
        MPI = _mpi()
        m = self.host_of[rank]
        with signals.deferred():
            head = self.down_buf[rank][:HEAD].view(np.int64)
            head[:] = 0
            head[0], head[1], head[6] = self.id, rank, int(consumed)
            for i, v in enumerate(meta):
                head[2 + i] = v
            if consumed:                 # its message is read: the next may come in
                self.have.pop(rank, None)
                self.recv[rank] = self.comm.Irecv([self.up_buf[rank], MPI.BYTE], source=m, tag=DATA + rank)
            self.sends[rank] = self.comm.Isend([self.down_buf[rank], MPI.BYTE], dest=m, tag=DATA + rank)
            self.n_down[rank] += 1

    def status(self, rank):
        if rank in self.host_of:
            return self.remote_status[rank]
        return self.local.status(rank)

    def wait_any(self, timeout):
        """Return once a worker (of any host) has a pending message, or after ``timeout``."""
        if self.pending():
            return True
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return bool(self.pending())
            self.control.local.sleep(min(left, POLL))   # local workers wake it; MPI does not
            if self.pending():
                return True

    def stop(self):
        """Every worker leaves its loop; then the run is closed with every other host
        (nothing of it stays in flight; at most ``DRAIN`` seconds)."""
        if self.stopped:
            return
        self.stopped = True
        self.local.stop()
        if not self.opened:
            return
        with signals.deferred():
            self.have.clear()
            for m, rs in self.agents.items():
                self.ctrl.send(("close", self.token, {r: self.n_down[r] for r in rs}), m, CTRL_DOWN)
            deadline = time.monotonic() + DRAIN
            while not self._drained():
                if time.monotonic() > deadline:
                    self._say(f"hosts {sorted(set(self.agents) - set(self.closed))} did not close the "
                              f"channel within {DRAIN:.0f} s")
                    break
                time.sleep(POLL)
            left = max(0.0, deadline - time.monotonic())
            self._complete(list(self.sends.values()), left)
            for r, req in self.sends.items():
                _orphan(req, self.down_buf[r])
            for req in self.recv.values():    # (only if a host did not close in time)
                if req is not None:
                    _cancel(req)
            self.sends, self.recv = {}, {}
            self.ctrl.finish()

    def _drained(self):
        self._service()
        MPI = _mpi()
        done = True
        for m, rs in self.agents.items():
            sent = self.closed.get(m)
            if sent is None:
                done = False
                continue
            for r in rs:
                req = self.recv.get(r)
                if self.n_up[r] >= sent[r]:
                    if req is not None:
                        if _cancel(req):
                            self.n_up[r] += 1   # (cannot happen: the agent said how many)
                        self.recv[r] = None
                else:
                    done = False
                    if req is None:
                        self.recv[r] = self.comm.Irecv([self.up_buf[r], MPI.BYTE], source=m, tag=DATA + r)
        return done

    def _complete(self, reqs, seconds):
        """Wait (polling, serving the hub) up to ``seconds`` for ``reqs``; True if all done."""
        deadline = time.monotonic() + seconds
        while not all(r.Test() for r in reqs):
            if time.monotonic() > deadline:
                return False
            self._service()
            time.sleep(POLL)
        return True

    def _say(self, text):
        print(f"synkhronos: channel {self.token}: {text}", file=sys.stderr, flush=True)

    def close(self):
        try:
            self.stop()
        finally:
            self.local.close()


# ------------------------------------------------------------------------------------------
# the agent of another host


class HostRelay:
    """A host's end of the channels (its agent): makes the host's channel when the master
    opens a run, relays its workers' messages and the master's answers, reports its
    workers' states.  ``service`` runs at every step of the agent."""

    def __init__(self, w, control, first, pids):
        self.comm, self.host = w.chan, w.host
        self.ctl = control                # the host's ShmControl (the agent: slot 0)
        self.first = first                # global rank of slot 1
        self.pids = dict(pids)
        self.runs = []
        self.ctrl = _Control(self.comm)

    def service(self, replied):
        """One round; ``replied``: the last command every worker of the host has answered
        (a closed run's segment goes once its command is answered: a worker that had not
        attached yet would wait for it).  Returns whether anything happened."""
        MPI = _mpi()
        busy = False
        st = MPI.Status()
        while self.comm.Iprobe(source=0, tag=CTRL_DOWN, status=st):
            kind, token, *body = _recv_obj(self.comm, st)
            busy = True
            if kind == "open":
                try:
                    self.runs.append(_HostRun(self, token, *body))
                except Exception as e:        # e.g. no shared memory left on this host
                    print(f"synkhronos: host {self.host}: cannot open channel {token}: {e!r}", file=sys.stderr,
                          flush=True)
                    self.ctl.abort()          # its workers leave the command; the master sees the abort
                    self.runs.append(_FailedRun(self, token, body[0]))
            elif kind == "close":
                for run in self.runs:
                    if run.token == token:
                        run.close(body[0])
        for run in list(self.runs):
            busy = run.step() or busy
            if run.finished(replied):
                run.free()
                self.runs.remove(run)
        return busy

    def abandon(self):
        """The session ends: drop every run (what MPI may still use is kept alive)."""
        for run in self.runs:
            run.abandon()
        self.runs = []
        self.ctrl.finish()


class _HostRun:
    def __init__(self, relay, token, ranks, up_bytes, down_bytes, seq):
        self.relay, self.comm, self.token, self.id = relay, relay.comm, token, _run_id(token)
        self.seq = seq                    # the run's command
        self.ranks = tuple(int(r) for r in ranks)
        slots = {r: r - relay.first + 1 for r in self.ranks}
        self.ch = Channel.create(relay.ctl, self.ranks, up_bytes, down_bytes, token=token, slots=slots,
                                 pids=relay.pids)
        self.recv = {r: self._post(r) for r in self.ranks}
        self.up_req = {}
        self.forwarded = {r: 0 for r in self.ranks}
        self.n_up = {r: 0 for r in self.ranks}
        self.n_down = {r: 0 for r in self.ranks}
        self.reported = {}
        self.next_status = 0.0
        self.expect = None                # after close: {rank: answers the master sent}
        self.closed_sent = False
        relay.ctl.wake(list(slots.values()))   # workers waiting for the segment

    def _post(self, r):
        return self.comm.Irecv([self.ch.down_raw(r), _mpi().BYTE], source=0, tag=DATA + r)

    def step(self):
        busy = False
        with signals.deferred():
            for r in self.ranks:
                req = self.recv[r]
                if req is None or not req.Test():
                    continue
                busy = True
                self.recv[r] = None
                head = self.ch.down_raw(r)[:HEAD].view(np.int64)
                if int(head[0]) != self.id:
                    self.recv[r] = self._post(r)
                    continue
                self.n_down[r] += 1
                if self.expect is None:
                    meta, consumed = tuple(int(x) for x in head[2:6]), bool(head[6])
                    if consumed and r in self.up_req:     # (delivered: the master answered it)
                        self.up_req.pop(r).Wait()
                    self.ch.answer(r, meta, consumed)
                    self.recv[r] = self._post(r)
                elif self.n_down[r] < self.expect[r]:
                    self.recv[r] = self._post(r)
            if self.expect is None:
                for r in self.ch.pending():
                    seq = self.ch.up_seq(r)
                    if seq > self.forwarded[r]:
                        self._forward(r, seq)
                        busy = True
                now = time.monotonic()
                if now >= self.next_status:
                    self.next_status = now + STATUS_EVERY
                    states = {r: self.ch.status(r) for r in self.ranks}
                    changed = {r: s for r, s in states.items() if self.reported.get(r) != s}
                    if changed:
                        self.reported.update(changed)
                        self.relay.ctrl.send(("status", self.token, changed), 0, CTRL_UP)
            elif not self.closed_sent:
                if all(self.n_down[r] >= self.expect[r] for r in self.ranks):
                    for r in self.ranks:
                        if self.recv[r] is not None:
                            _cancel(self.recv[r])
                            self.recv[r] = None
                    self.relay.ctrl.send(("closed", self.token, dict(self.n_up)), 0, CTRL_UP)
                    self.closed_sent = busy = True
        return busy

    def _forward(self, r, seq):
        raw = self.ch.up_raw(r)
        head = raw[:HEAD].view(np.int64)
        head[:] = 0
        head[0], head[1], head[6] = self.id, r, seq
        head[2:6] = self.ch.message(r)
        self.up_req[r] = self.comm.Isend([raw, _mpi().BYTE], dest=0, tag=DATA + r)
        self.forwarded[r] = seq
        self.n_up[r] += 1

    def close(self, expect):
        self.expect = {int(r): int(n) for r, n in expect.items()}
        self.ch.stop()

    def finished(self, replied):
        """Closed with the master, every forwarded message delivered, and no worker can
        still be on its way to the segment (the host's workers answered the command)."""
        return self.closed_sent and replied >= self.seq and all(r.Test() for r in self.up_req.values())

    def free(self):
        self.up_req = {}
        self.ch.close()

    def abandon(self):
        for r, req in self.recv.items():
            if req is not None:
                _cancel(req)
        for r, req in self.up_req.items():
            _orphan(req, self.ch.up_raw(r))
        self.recv, self.up_req = {}, {}
        self.ch.close()


class _FailedRun:
    """A run this host could not open: its workers were aborted; it only closes."""

    def __init__(self, relay, token, ranks):
        self.relay, self.token, self.ranks = relay, token, tuple(ranks)
        self.closed_sent = False
        relay.ctrl.send(("status", token, {r: "failed" for r in self.ranks}), 0, CTRL_UP)

    def close(self, expect):
        self.relay.ctrl.send(("closed", self.token, {r: 0 for r in self.ranks}), 0, CTRL_UP)
        self.closed_sent = True

    def step(self):
        return False

    def finished(self, replied):
        return self.closed_sent

    def free(self):
        pass

    def abandon(self):
        pass
