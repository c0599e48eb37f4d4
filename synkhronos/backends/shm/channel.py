"""Asynchronous point-to-point channels between the master and each worker, inside ONE
command (shared memory inside a host; relayed over MPI between hosts).

The control plane runs commands in lockstep: the master sends, every rank runs its share,
the master collects.  Some exchanges do not fit that shape: a parameter server serves its
workers as their messages arrive, each at its own pace, for as long as a run lasts.  Such
a run is one long command; while it runs, a ``Channel`` carries the messages:

* one shared segment per channel and host, ``<host session prefix>_ch<token>`` (mode 0600,
  random token), created by the master (``Channel.create``; on another host, by its agent)
  and attached by every worker of the command (``Channel.attach``), which reads the layout
  and the workers' ranks from its header; the session's cleanup removes it with everything
  else of the session;
* per worker, an **up** area (worker -> master) and a **down** area (master -> worker),
  each with a few int64 of metadata, and sequence numbers in a header:

  ===============  ============================================================================
  ``UP_SEQ``       the worker's message count: it writes its up area, then increments this
  ``UP_DONE``      the last message the master has consumed (it may then be overwritten)
  ``DOWN_SEQ``     the master's answer count: it writes the down area, then increments this
  ``PID``          the worker's process, for liveness (``status``)
  ``STATE``        starting, running, finished, failed (written by the worker)
  ``RANK``         the worker's rank (written by the creator)
  ===============  ============================================================================

  and a global ``STOP`` flag.  A worker sends only when its previous message has been
  answered (``UP_DONE == UP_SEQ``) and reads its down area only after ``DOWN_SEQ`` moved:
  each side writes an area only while the other cannot be reading it, so the areas need no
  locks.  State is in the header; semaphores only wake (the control plane's: the master's
  and each worker's own), so a lost or extra wake-up delays nobody and fools nobody;
* waiting: a worker waits through its control plane's ``Waiter`` (which watches that the
  master is alive, and leaves when the command is aborted); the master waits with
  ``wait_any`` and checks each worker itself (``status``: a dead or stopped worker is
  reported to the caller and skipped, so one worker cannot stall the others).

Each area is preceded by ``HEAD`` bytes that the channel itself never uses: a relay between
hosts writes a message's metadata there and sends header and data as ONE message straight
from (into) the area (``up_raw`` / ``down_raw``).  Across hosts (``mpiexec``) the master's
channel is ``backends.mpi.channel.HostsChannel``: this channel for the workers of its own
host, and for each other host the same channel owned by that host's agent, which relays
its workers' messages over MPI (``create`` picks the implementation from the control
plane; workers ``attach`` alike on every host)."""
import os
import secrets
import time

import numpy as np
import posix_ipc

from . import segments as shm
from ..host.procfs import process_state
from ...channel import FAILED, FINISHED, N_META
from ...errors import Aborted

_ALIGN = 64
HEAD = 64                                      # bytes before each area, for relays (unused here)
G_STOP, G_NW, G_UPB, G_DOWNB, G_READY = 0, 1, 2, 3, 4
_GLOBAL = 8                                    # int64 of the global header (one cache line)
PID, UP_SEQ, UP_DONE, DOWN_SEQ, STATE, RANK = 0, 1, 2, 3, 4, 5
_META = 8                                      # up meta at 8..11, down meta at 12..15
_STRIDE = 16                                   # int64 per worker (two cache lines)


def _align(x):
    return (x + _ALIGN - 1) // _ALIGN * _ALIGN


def channel_name(prefix, token):
    """The segment of channel ``token`` in the host session ``prefix`` (a host's own
    session prefix is random: the name cannot be guessed)."""
    return f"{prefix}_ch{token}"


def _layout(n_workers, up_bytes, down_bytes):
    """(header int64 count, [up area offsets], [down area offsets], segment size): each area
    starts ``HEAD`` bytes after an aligned offset (the offsets point at the data)."""
    n_head = _GLOBAL + _STRIDE * n_workers
    off = _align(8 * n_head)
    ups, downs = [], []
    for _ in range(n_workers):
        ups.append(off + HEAD)
        off = _align(off + HEAD + max(8, up_bytes))
        downs.append(off + HEAD)
        off = _align(off + HEAD + max(8, down_bytes))
    return n_head, ups, downs, off


class Channel:
    """The up/down areas of the ``ranks`` (workers) of one command, seen by one process.

    ``slots``: rank -> the control plane's slot of that rank (whose semaphore wakes it),
    when they differ (the hosts of a multi-host session number their slots from 1);
    ``me``: the worker's rank (worker side)."""

    def __init__(self, control, token, ranks, up_bytes, down_bytes, seg, slots=None, me=None):
        self.control, self.token = control, token
        self.name = seg.name
        self.ranks = tuple(int(r) for r in ranks)
        self.index = {r: i for i, r in enumerate(self.ranks)}
        self.slot = {r: (r if slots is None else int(slots[r])) for r in self.ranks}
        self.up_bytes, self.down_bytes = int(up_bytes), int(down_bytes)
        self.me = me
        n_head, self._up_off, self._down_off, _ = _layout(len(self.ranks), self.up_bytes, self.down_bytes)
        self.seg = seg
        self.head = seg.array(np.int64, (n_head,))
        self.seen = {r: 0 for r in self.ranks}         # worker side: answers read
        self._gone = {}                                 # master side: rank -> reason reported

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def create(cls, control, ranks, up_bytes, down_bytes, token=None, slots=None, pids=None):
        """A new channel to ``ranks`` owned by this process (the master, or across hosts a
        host's agent); its ``token`` goes to the workers.  ``pids``: rank -> its process,
        known before it attaches (a worker that dies before attaching is then seen dead)."""
        token = secrets.token_hex(8) if token is None else token
        ranks = tuple(int(r) for r in ranks)
        n_head, _, _, size = _layout(len(ranks), int(up_bytes), int(down_bytes))
        shm.check_space(size)
        seg = shm.Segment(channel_name(control.prefix, token), size, create=True)
        try:
            head = seg.array(np.int64, (n_head,))
            head[:] = 0
            head[G_NW], head[G_UPB], head[G_DOWNB] = len(ranks), int(up_bytes), int(down_bytes)
            for i, r in enumerate(ranks):
                head[_GLOBAL + _STRIDE * i + RANK] = r
                if pids and pids.get(r):
                    head[_GLOBAL + _STRIDE * i + PID] = pids[r]
            head[G_READY] = 1                          # workers may read the layout now
            return cls(control, token, ranks, up_bytes, down_bytes, seg, slots)
        except BaseException:
            seg.unlink()
            raise

    @classmethod
    def attach(cls, control, token, me):
        """Worker ``me``'s view of channel ``token`` of its host (the layout is read from the
        segment); records the worker's pid.  Across hosts the host's agent makes the
        segment when the master opens the run: until then this waits (through the control
        plane's waiter: the master's death or the command's abort end the wait)."""
        name = channel_name(control.prefix, token)
        found = []

        def ready():
            if control.aborted():
                return True
            if not found:
                try:
                    found.append(shm.Segment(name))
                except (posix_ipc.ExistentialError, ValueError):   # not there yet; not sized yet
                    return False
            seg = found[0]
            if seg.size >= 8 * _GLOBAL and int(seg.array(np.int64, (_GLOBAL,))[G_READY]) == 1:
                return True
            found.clear()                  # not made yet: look again next time (a fresh view)
            return False

        control.waiter.wait(ready, control.sleep, what="the channel of this host")
        if control.aborted():
            raise Aborted("the command was aborted")
        seg = found[0]
        g = seg.array(np.int64, (_GLOBAL,))
        nw, upb, downb = int(g[G_NW]), int(g[G_UPB]), int(g[G_DOWNB])
        head = seg.array(np.int64, (_GLOBAL + _STRIDE * nw,))
        ranks = [int(head[_GLOBAL + _STRIDE * i + RANK]) for i in range(nw)]
        if me not in ranks:
            raise RuntimeError(f"channel {token}: rank {me} is not one of its workers {ranks}")
        ch = cls(control, token, ranks, upb, downb, seg, me=me)
        ch._set(me, PID, os.getpid())
        return ch

    def close(self):
        """Unmap (and, in the owner, remove) the segment.  Views handed out stay valid
        until they are dropped."""
        if self.seg is not None:
            if self.seg.owner:
                self.seg.unlink()
            self.seg = None

    # ---- header ------------------------------------------------------------------------------
    def _i(self, rank, field):
        return _GLOBAL + _STRIDE * self.index[rank] + field

    def _get(self, rank, field):
        return int(self.head[self._i(rank, field)])

    def _set(self, rank, field, value):
        self.head[self._i(rank, field)] = value

    def up(self, rank, dtype=np.uint8, count=None):
        """The up area of ``rank`` as an array of ``dtype`` (``count`` elements, default:
        as many as fit)."""
        dtype = np.dtype(dtype)
        count = self.up_bytes // dtype.itemsize if count is None else count
        return self.seg.array(dtype, (count,), offset=self._up_off[self.index[rank]])

    def down(self, rank, dtype=np.uint8, count=None):
        dtype = np.dtype(dtype)
        count = self.down_bytes // dtype.itemsize if count is None else count
        return self.seg.array(dtype, (count,), offset=self._down_off[self.index[rank]])

    def up_raw(self, rank):
        """``HEAD`` bytes then the up area of ``rank``: one relay message (bytes)."""
        return self.seg.array(np.uint8, (HEAD + self.up_bytes,), offset=self._up_off[self.index[rank]] - HEAD)

    def down_raw(self, rank):
        return self.seg.array(np.uint8, (HEAD + self.down_bytes,),
                              offset=self._down_off[self.index[rank]] - HEAD)

    def up_seq(self, rank):
        """How many messages ``rank`` has sent (a relay forwards each once)."""
        return self._get(rank, UP_SEQ)

    def stopped(self):
        return bool(self.head[G_STOP])

    # ---- worker side -------------------------------------------------------------------------
    def set_state(self, state):
        self._set(self.me, STATE, state)

    def send(self, meta=()):
        """Publish the message written into this worker's up area (``meta``: up to
        ``N_META`` ints) and wake the master.  Only after the previous one was answered."""
        me = self.me
        seq = self._get(me, UP_SEQ)
        if self._get(me, UP_DONE) != seq:
            raise RuntimeError("channel: a message was sent before the previous one was answered")
        for i, m in enumerate(meta):
            self._set(me, _META + i, m)
        self._set(me, UP_SEQ, seq + 1)              # the commit point
        self.control.wake([self.control.master_rank])

    def wait_answer(self, what="an answer of the master"):
        """Wait for the master's next answer (or the stop): returns its metadata (the down
        area holds its data), or None once the master stopped the channel.  Raises Aborted
        when the command was aborted and MasterDied when the master is gone."""
        me, ctl = self.me, self.control

        def ready():
            return (self._get(me, DOWN_SEQ) > self.seen[me] or self.stopped() or ctl.aborted())

        ctl.waiter.wait(ready, ctl.sleep, what=what)
        if ctl.aborted():
            raise Aborted("the command was aborted")
        seq = self._get(me, DOWN_SEQ)
        if seq > self.seen[me]:
            self.seen[me] = seq
            return tuple(self._get(me, _META + N_META + i) for i in range(N_META))
        return None

    # ---- master side -------------------------------------------------------------------------
    def pending(self):
        """The workers whose latest message the master has not consumed yet."""
        return [r for r in self.ranks if self._get(r, UP_SEQ) > self._get(r, UP_DONE)]

    def message(self, rank):
        """The metadata of ``rank``'s pending message (its up area holds the data)."""
        return tuple(self._get(rank, _META + i) for i in range(N_META))

    def answer(self, rank, meta=(), consumed=True):
        """Publish the answer written into ``rank``'s down area (its pending message, if
        any, is consumed first) and wake the worker."""
        if consumed:
            self._set(rank, UP_DONE, self._get(rank, UP_SEQ))
        for i, m in enumerate(meta):
            self._set(rank, _META + N_META + i, m)
        self._set(rank, DOWN_SEQ, self._get(rank, DOWN_SEQ) + 1)
        self.control.wake([self.slot[rank]])

    def stop(self):
        """Tell every worker to leave its loop (``wait_answer`` returns None)."""
        self.head[G_STOP] = 1
        self.control.wake([self.slot[r] for r in self.ranks])

    def status(self, rank):
        """``"alive"``, ``"starting"`` (no pid yet), ``"finished"``, ``"failed"``, ``"dead"``
        (its process is gone or a zombie) or ``"stopped"`` (SIGSTOP, a debugger)."""
        state = self._get(rank, STATE)
        if state == FINISHED:
            return "finished"
        if state == FAILED:
            return "failed"
        pid = self._get(rank, PID)
        if pid <= 0:
            return "starting"
        st = process_state(pid)
        if st is None or st in ("Z", "X"):
            return "dead"
        if st in ("T", "t"):
            return "stopped"
        return "alive"

    def wait_any(self, timeout):
        """Return once a worker has a pending message, or after ``timeout`` seconds."""
        if self.pending():
            return True
        end = time.perf_counter() + min(timeout, 200e-6)
        while time.perf_counter() < end:                  # short spin: replies come fast
            if self.pending():
                return True
            os.sched_yield()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return bool(self.pending())
            self.control.sleep(min(left, 0.02))
            if self.pending():
                return True
