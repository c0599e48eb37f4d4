"""Asynchronous point-to-point channels between the master and each worker, inside ONE
command (shared memory, one host).

The control plane runs commands in lockstep: the master sends, every rank runs its share,
the master collects.  Some exchanges do not fit that shape: a parameter server serves its
workers as their messages arrive, each at its own pace, for as long as a run lasts.  Such
a run is one long command; while it runs, a ``Channel`` carries the messages:

* one shared segment per channel, ``<session prefix>_ch<tag>``, created by the master
  (``Channel.create``) and attached by every worker of the command (``Channel.attach``);
  the session's cleanup removes it with everything else of the session;
* per worker, an **up** area (worker -> master) and a **down** area (master -> worker),
  each with a few int64 of metadata, and sequence numbers in a header:

  ===============  ============================================================================
  ``UP_SEQ``       the worker's message count: it writes its up area, then increments this
  ``UP_DONE``      the last message the master has consumed (it may then be overwritten)
  ``DOWN_SEQ``     the master's answer count: it writes the down area, then increments this
  ``PID``          the worker's process, for liveness (``status``)
  ``STATE``        starting, running, finished, failed (written by the worker)
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

Shared memory only: the channel needs the master and its workers on one host.  Under the
multi-host backend (``mpiexec``) ``create`` and ``attach`` raise ``NotImplementedError``."""
import os
import secrets
import struct
import time

import numpy as np

from . import shm
from ..errors import Aborted
from ..launcher import process_state

_ALIGN = 64
G_STOP, G_NW, G_UPB, G_DOWNB = 0, 1, 2, 3
_GLOBAL = 8                                    # int64 of the global header (one cache line)
PID, UP_SEQ, UP_DONE, DOWN_SEQ, STATE = 0, 1, 2, 3, 4
_META = 8                                      # up meta at 8..11, down meta at 12..15
N_META = 4
_STRIDE = 16                                   # int64 per worker (two cache lines)
STARTING, RUNNING, FINISHED, FAILED = 0, 1, 2, 3
_F64 = struct.Struct("<d")
_I64 = struct.Struct("<q")


def float_bits(x):
    """A float64 as an int64 (to carry it in a message's metadata)."""
    return _I64.unpack(_F64.pack(float(x)))[0]


def bits_float(i):
    return _F64.unpack(_I64.pack(int(i)))[0]


def _align(x):
    return (x + _ALIGN - 1) // _ALIGN * _ALIGN


def check_local(control):
    """NotImplementedError unless ``control`` is the shared-memory control of one host."""
    from .shm_control import ShmControl
    if not isinstance(control, ShmControl) or control.lead is not None:
        raise NotImplementedError(
            "synkhronos channels (the parameter server's asynchronous exchange) run through shared "
            "memory between the ranks of one host; this session spans several hosts (mpiexec). "
            "Use a synchronous exchange there (BSP, EASGD or local SGD).")


class Channel:
    """The up/down areas of the ``ranks`` (workers) of one command, seen by one process."""

    def __init__(self, control, name, ranks, up_bytes, down_bytes, create):
        check_local(control)
        self.control, self.name = control, name
        self.ranks = tuple(int(r) for r in ranks)
        self.index = {r: i for i, r in enumerate(self.ranks)}
        self.up_bytes, self.down_bytes = int(up_bytes), int(down_bytes)
        head = _align(8 * (_GLOBAL + _STRIDE * len(self.ranks)))
        self._up_off, self._down_off = [], []
        off = head
        for _ in self.ranks:
            self._up_off.append(off)
            off = _align(off + max(8, self.up_bytes))
            self._down_off.append(off)
            off = _align(off + max(8, self.down_bytes))
        if create:
            shm.check_space(off)
        self.seg = shm.Segment(name, off, create=create)
        self.head = self.seg.array(np.int64, (_GLOBAL + _STRIDE * len(self.ranks),))
        if create:
            self.head[:] = 0
            self.head[G_NW], self.head[G_UPB], self.head[G_DOWNB] = len(self.ranks), self.up_bytes, self.down_bytes
        self.seen = {r: 0 for r in self.ranks}         # worker side: answers read
        self._gone = {}                                 # master side: rank -> reason reported

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def create(cls, control, ranks, up_bytes, down_bytes):
        """The master's new channel to ``ranks``; ``name`` goes to the workers."""
        return cls(control, f"{control.prefix}_ch{secrets.token_hex(4)}", ranks, up_bytes, down_bytes, True)

    @classmethod
    def attach(cls, control, name, ranks, up_bytes, down_bytes):
        """A worker's view of the master's channel ``name``; records the worker's pid."""
        ch = cls(control, name, ranks, up_bytes, down_bytes, False)
        ch._set(control.rank, PID, os.getpid())
        return ch

    def close(self):
        """Unmap (and, in the master, remove) the segment.  Views handed out stay valid
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

    def stopped(self):
        return bool(self.head[G_STOP])

    # ---- worker side -------------------------------------------------------------------------
    def set_state(self, state):
        self._set(self.control.rank, STATE, state)

    def send(self, meta=()):
        """Publish the message written into this worker's up area (``meta``: up to
        ``N_META`` ints) and wake the master.  Only after the previous one was answered."""
        me = self.control.rank
        seq = self._get(me, UP_SEQ)
        if self._get(me, UP_DONE) != seq:
            raise RuntimeError("channel: a message was sent before the previous one was answered")
        for i, m in enumerate(meta):
            self._set(me, _META + i, m)
        self._set(me, UP_SEQ, seq + 1)              # the commit point
        self.control._post([self.control.master_rank])

    def wait_answer(self, what="an answer of the master"):
        """Wait for the master's next answer (or the stop): returns its metadata (the down
        area holds its data), or None once the master stopped the channel.  Raises Aborted
        when the command was aborted and MasterDied when the master is gone."""
        me, ctl = self.control.rank, self.control

        def ready():
            return (self._get(me, DOWN_SEQ) > self.seen[me] or self.stopped() or ctl.aborted())

        ctl.waiter.wait(ready, ctl._sleep, what=what)
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
        self.control._post([rank])

    def stop(self):
        """Tell every worker to leave its loop (``wait_answer`` returns None)."""
        self.head[G_STOP] = 1
        self.control._post(list(self.ranks))

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
            self.control._sleep(min(left, 0.02))
            if self.pending():
                return True
