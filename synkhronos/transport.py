"""Shared-memory transport: commands, replies and barriers between the ranks of one machine.

The master writes a command into its mailbox (a growable shared-memory segment) and posts
each worker's "go" semaphore; each worker writes its reply into its own mailbox and posts
its "done" semaphore.  Objects travel as pickle protocol 5 with out-of-band buffers, so
numpy arrays in a message are copied once into shared memory and read as views.
Every wait is bounded by a short tick after which the waiter checks that the other side is
alive (and, inside a multi-phase command, whether another rank aborted it).

Another transport (MPI, sockets) only has to provide the same methods."""
import os
import pickle
import re
import struct
from os import sched_yield as _yield
from time import perf_counter as _now

import posix_ipc

from . import shm
from .errors import Aborted

CMD_SEQ, ABORT_SEQ, MASTER_PID = 0, 1, 2
_GEN_BASE = 8
_ALIGN = 64
_HDR = struct.Struct("<QQ")
_BUF = struct.Struct("<QQ")


def _align(x):
    return (x + _ALIGN - 1) // _ALIGN * _ALIGN


class Mailbox:
    """One rank's outgoing message area: a segment it owns and regrows as needed."""

    def __init__(self, prefix, rank, gen_slot):
        self.prefix, self.rank, self.gen_slot = prefix, rank, gen_slot
        self.seg = None

    def write(self, obj):
        bufs = []
        header = pickle.dumps(obj, protocol=5, buffer_callback=bufs.append)
        raws = [b.raw() for b in bufs]
        off = _align(_HDR.size + _BUF.size * len(raws) + len(header))
        offsets = []
        for r in raws:
            offsets.append(off)
            off = _align(off + r.nbytes)
        if self.seg is None or self.seg.size < off:
            self._grow(off)
        mm = self.seg.mm
        _HDR.pack_into(mm, 0, len(header), len(raws))
        pos = _HDR.size
        for o, r in zip(offsets, raws):
            _BUF.pack_into(mm, pos, o, r.nbytes)
            pos += _BUF.size
        mm[pos:pos + len(header)] = header
        for o, r in zip(offsets, raws):
            mm[o:o + r.nbytes] = r

    def _grow(self, needed):
        gen = int(self.gen_slot[0]) + 1
        size = max(1 << 16, int(needed * 1.5))
        size = (size + shm.PAGE - 1) // shm.PAGE * shm.PAGE
        new = shm.Segment(f"{self.prefix}_m{self.rank}_{gen}", size, create=True)
        old, self.seg = self.seg, new
        self.gen_slot[0] = gen
        if old is not None:
            old.unlink()

    def close(self):
        if self.seg is not None:
            self.seg.unlink()
            self.seg = None


class MailboxReader:
    """Reads another rank's mailbox, re-attaching when its owner regrew it."""

    def __init__(self, prefix, rank, gen_slot):
        self.prefix, self.rank, self.gen_slot = prefix, rank, gen_slot
        self.seg, self.gen = None, 0

    def read(self):
        gen = int(self.gen_slot[0])
        if gen != self.gen:
            self.seg = shm.Segment(f"{self.prefix}_m{self.rank}_{gen}")
            self.gen = gen
        mm = self.seg.mm
        hlen, nbuf = _HDR.unpack_from(mm, 0)
        pos = _HDR.size
        views = []
        mv = memoryview(mm)
        for _ in range(nbuf):
            o, ln = _BUF.unpack_from(mm, pos)
            pos += _BUF.size
            views.append(mv[o:o + ln])
        header = mm[pos:pos + hlen]
        return pickle.loads(header, buffers=views)


class ShmTransport:
    """Commands, replies and barriers for ``n`` ranks through POSIX shared memory."""

    TICK_IDLE = 0.5      # worker waiting for the next command
    TICK_BUSY = 0.02     # anyone waiting inside a command
    SPIN = 200e-6        # poll this long before sleeping on a semaphore

    def __init__(self, prefix, n, rank, master_rank, create):
        self.prefix, self.n, self.rank, self.master_rank = prefix, n, rank, master_rank
        self.is_master = rank == master_rank
        ctrl_bytes = 8 * (_GEN_BASE + n)
        self.ctrl_seg = shm.Segment(prefix + "_ctrl", ctrl_bytes, create=create)
        self.ctrl = self.ctrl_seg.array("int64", (_GEN_BASE + n,))
        if create:
            self.ctrl[MASTER_PID] = os.getpid()     # lets a later run reap this one if it dies
        opener = shm.new_semaphore if create else posix_ipc.Semaphore
        self.workers = [r for r in range(n) if r != master_rank]
        self.go = {r: opener(f"{prefix}_go{r}") for r in self.workers}
        self.done = {r: opener(f"{prefix}_dn{r}") for r in self.workers}
        self.bar = [opener(f"{prefix}_br{r}") for r in range(n)]
        gen = lambda r: self.ctrl[_GEN_BASE + r:_GEN_BASE + r + 1]
        self.mailbox = Mailbox(prefix, rank, gen(rank))
        self.readers = {r: MailboxReader(prefix, r, gen(r)) for r in range(n) if r != rank}
        self.seq = int(self.ctrl[CMD_SEQ])

    # ---- master side -------------------------------------------------------------------
    def send(self, obj):
        """Master: hand ``obj`` to every worker and wake them."""
        self.mailbox.write(obj)
        self.seq += 1
        self.ctrl[CMD_SEQ] = self.seq
        for r in self.workers:
            self.go[r].release()
        return self.seq

    def wait_done(self, rank, alive):
        """Master: wait until worker ``rank`` has replied; ``alive()`` is checked every tick."""
        _wait(self.done[rank], self.TICK_BUSY, alive, self.SPIN)

    def read_reply(self, rank):
        return self.readers[rank].read()

    def abort(self):
        """Make every rank leave the current multi-phase command at its next wait."""
        self.ctrl[ABORT_SEQ] = self.seq

    def drain(self):
        """Master, all workers idle: zero every semaphore left over by an aborted command."""
        for sem in list(self.done.values()) + self.bar:
            while True:
                try:
                    sem.acquire(0)
                except posix_ipc.BusyError:
                    break

    # ---- worker side -------------------------------------------------------------------
    def recv(self, alive):
        """Worker: wait for the next command (checking ``alive()`` every tick) and return it."""
        _wait(self.go[self.rank], self.TICK_IDLE, alive, self.SPIN)
        self.seq = int(self.ctrl[CMD_SEQ])
        return self.readers[self.master_rank].read()

    def reply(self, obj):
        self.mailbox.write(obj)
        self.done[self.rank].release()

    def abort_from_worker(self):
        """Worker: its command failed; make the other ranks leave their barriers."""
        self.ctrl[ABORT_SEQ] = self.seq

    # ---- any rank ------------------------------------------------------------------------
    def aborted(self):
        return int(self.ctrl[ABORT_SEQ]) == self.seq

    def barrier(self, alive, check_after=True):
        """All ranks meet; raises Aborted if any rank aborted the current command (also when
        every post had already arrived, unless ``check_after`` is False: then the caller
        checks, e.g. after an error that every rank must raise alike)."""
        if self.n == 1:
            return
        for r in range(self.n):
            if r != self.rank:
                self.bar[r].release()
        mine = self.bar[self.rank]

        def ok():
            if self.aborted():
                raise Aborted("another rank failed during this command")
            return alive()

        for _ in range(self.n - 1):
            _wait(mine, self.TICK_BUSY, ok, self.SPIN)
        if check_after and self.aborted():   # the posts were all there, but it was aborted
            raise Aborted("another rank failed during this command")

    def close(self):
        self.mailbox.close()
        if self.is_master:
            shm.remove_all(self.prefix)


_SESSION_CTRL = re.compile(r"synk_[0-9a-f]{16}_ctrl")


def seg_owner(name):
    try:
        return os.stat(os.path.join(shm.SHM_DIR, name + "_ctrl")).st_uid
    except OSError:
        return -1


def reap_stale_sessions():
    """Remove the segments of earlier sessions of this user whose master process is gone.

    A session cleans up after itself on close, on a master's SIGTERM and when its master
    dies; only when every process of a session was killed at once is there nobody left to
    do it.  Returns the number of sessions removed."""
    prefixes = {e[:-len("_ctrl")] for e in shm.leftovers("synk_") if _SESSION_CTRL.fullmatch(e)}
    reaped = 0
    for p in prefixes:
        try:
            seg = shm.Segment("/" + p + "_ctrl")
            pid = int(seg.array("int64", (_GEN_BASE,))[MASTER_PID])
        except (OSError, ValueError, posix_ipc.Error):
            continue
        if pid <= 0 or seg_owner(p) != os.getuid():
            continue
        try:
            os.kill(pid, 0)
            continue                  # its master is alive (or the pid was reused): leave it
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shm.remove_all("/" + p)
        reaped += 1
    return reaped


def _wait(sem, tick, alive, spin=0.0):
    """Acquire ``sem``; every ``tick`` seconds call ``alive()``, which raises or returns False to stop.

    With ``spin`` > 0 it first polls the semaphore for that many seconds without sleeping:
    waking a sleeping process costs tens of microseconds, which dominates tiny calls."""
    if spin:
        end = _now() + spin
        while sem.value == 0:
            if _now() > end:
                break
            _yield()         # if another process wants this core (maybe the peer), let it run
        else:
            try:
                sem.acquire(0)
                return
            except posix_ipc.BusyError:
                pass
    while True:
        try:
            sem.acquire(tick)
            return
        except posix_ipc.BusyError:
            if alive() is False:
                raise ConnectionError("peer is gone")
        except posix_ipc.SignalError:
            # A signal interrupted the wait and its Python handler has run; posix_ipc hides
            # what that handler raised (a timeout, SystemExit …), so stop waiting: the caller
            # aborts the command and the next command collects it.
            raise
