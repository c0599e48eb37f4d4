"""The control plane: how the master's commands reach the ranks, and their replies come back.

A command is ``(name, args, forget)`` numbered by a sequence number that only grows; every
reply carries the number of the command it answers, so a reply left over from an
interrupted command can never be taken for the current one.  Besides commands and replies
the plane gives the ranks of a command three ways to agree:

* ``abort(seq)``: any rank makes every rank leave the waits of command ``seq``;
* ``barrier()``: all ranks meet (raises ``Aborted`` if the command was aborted);
* ``vote(ok)``: all-or-nothing decisions.  Every rank votes; all decide "commit" only if
  every rank voted yes, so state changed on one rank is changed on all or on none (signals
  are held from a rank's vote to the end of the command: an interrupt cannot split it).

and it delivers a call's inputs: ``alloc`` gives the master buffers that ranks can read
(``view``), and ``forget`` drops the ones the master released.

Implementations: ``backends.shm_control.ShmControl`` (one host, POSIX shared memory).
Every wait goes through a ``Waiter``, which owns the policy: liveness of the other side,
stall warnings naming the ranks still owed, and an optional timeout."""
import os
import sys
import time

import numpy as np

from . import shards
from .errors import StallTimeout

DEFAULT_STALL = 60.0


def env_seconds(name, default):
    """A duration from the environment (None when unset, empty or "0"/"none")."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    if raw.strip().lower() in ("0", "none", "off"):
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be a number of seconds") from None
    if value <= 0:
        return None
    return value


class Waiter:
    """How one process waits for others: a liveness check every tick, a warning each time
    a wait passes another ``stall`` seconds, an exception after ``timeout`` seconds.

    ``check()`` raises when the other side is gone (it may also return the ranks it
    considers stopped).  ``stall``/``timeout`` of None disable them."""

    TICK = 0.02          # inside a command
    TICK_IDLE = 0.5      # a worker waiting for the next command
    SPIN = 200e-6        # poll this long before sleeping (``fork(spin=...)``, env SYNK_SPIN)
    HOT = 20e-6          # of which the first part without yielding the core

    def __init__(self, check, stall=DEFAULT_STALL, timeout=None, stream=None, spin=None):
        self.check = check
        self.stall, self.timeout = stall, timeout
        self.stream = stream
        self.spin = self.SPIN if spin is None else spin
        self.service = None          # called at every look (e.g. messages from other hosts)

    def wait(self, ready, sleep, owed=None, what="command", idle=False):
        """Return once ``ready()`` is true.  ``sleep(t)`` blocks at most ``t`` seconds (or
        until woken); ``owed()`` names the ranks still awaited (for messages)."""
        if self.service is not None:
            service = self.service
            inner = ready

            def ready():
                service()
                return inner()
        if ready():
            return
        now = time.perf_counter()
        hot, end = now + min(self.spin, self.HOT), now + self.spin
        while time.perf_counter() < hot:     # the answer is usually a few µs away: just look
            if ready():
                return
        while time.perf_counter() < end:
            if ready():
                return
            os.sched_yield()     # if the peer wants this core, let it run
        tick = self.TICK_IDLE if idle else self.TICK
        start = time.monotonic()
        next_warn = self.stall
        while True:
            sleep(tick)
            if ready():
                return
            self.check()
            if idle:
                continue
            waited = time.monotonic() - start
            if self.timeout is not None and waited >= self.timeout:
                raise StallTimeout(_owed(owed), waited, what)
            if next_warn is not None and waited >= next_warn:
                next_warn += self.stall
                self._warn(_owed(owed), waited, what)

    def _warn(self, ranks, waited, what):
        stream = self.stream or sys.stderr
        who = f"rank(s) {', '.join(map(str, ranks))}" if ranks else "the other ranks"
        try:
            print(f"synkhronos: stall: waited {waited:.0f} s for {who} during {what} (still waiting; "
                  "fork(timeout=...) or SYNK_TIMEOUT turns a stall into an error)", file=stream, flush=True)
        except (OSError, ValueError):
            pass


def spin_seconds(value):
    """How long waits poll before sleeping: ``value`` (seconds), else env ``SYNK_SPIN``, else
    ``Waiter.SPIN``.  Longer spins wake faster after a pause between calls, and burn that
    much of a core (yielding it to anyone who wants it) each time a rank waits."""
    what = "spin"
    if value is None:
        raw = os.environ.get("SYNK_SPIN", "").strip()
        if not raw:
            return Waiter.SPIN
        what = f"environment variable SYNK_SPIN={raw!r}"
        try:
            value = float(raw)
        except ValueError:
            value = raw
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{what} must be a number of seconds in [0, 1] (e.g. 0.001), got {value!r}")
    return float(value)


def _owed(owed):
    try:
        return sorted(owed()) if owed is not None else []
    except Exception:
        return []


class Buffer:
    """Memory the master fills and ranks read: ``handle`` names it for the ranks."""

    handle = None

    def array(self, dtype, shape):
        raise NotImplementedError

    def release(self):
        raise NotImplementedError


class Control:
    """Interface of a control plane, seen from one rank (master or worker).

    Master side: ``send``, ``collect``, ``committed``.  Worker side: ``receive``, ``reply``.
    Every rank: ``abort``, ``aborted``, ``barrier``, ``vote``, ``view``, ``forget``.
    Master only: ``alloc`` (buffers for Data and staged values)."""

    rank = n = master_rank = None
    workers = ()
    waiter = None

    # ---- master --------------------------------------------------------------------------
    def send(self, seq, message, needs=()):
        """Hand command ``seq`` to every worker and wake them.  ``needs`` (``plans.Need``, or
        a function that makes them: only a plane that uses them pays for them): the master's
        data the command's ranks read (a plane whose ranks cannot read the master's buffers
        in place ships it to them)."""
        raise NotImplementedError

    def committed(self):
        """The sequence number of the last command the workers can see."""
        raise NotImplementedError

    def collect(self, seq, ranks, what="command"):
        """Wait for the replies of ``ranks`` to command ``seq``; yields ``(rank, reply)`` as
        each one is read (a caller interrupted midway keeps what it got)."""
        raise NotImplementedError

    def alloc(self, nbytes, tag="d"):
        """A ``Buffer`` of at least ``nbytes`` that every rank can ``view``."""
        raise NotImplementedError

    # ---- worker --------------------------------------------------------------------------
    def receive(self):
        """Wait for the next command; returns ``(seq, message)``."""
        raise NotImplementedError

    def reply(self, seq, obj):
        raise NotImplementedError

    # ---- every rank ----------------------------------------------------------------------
    def begin(self, seq):
        """This rank starts command ``seq`` (barrier and vote numbering restart)."""
        raise NotImplementedError

    def abort(self, seq=None):
        """Make every rank leave the waits of command ``seq`` (default: the current one)."""
        raise NotImplementedError

    def aborted(self):
        raise NotImplementedError

    def barrier(self, check_after=True):
        """All ranks meet.  Raises ``Aborted`` when the command was aborted (also when every
        rank had arrived, unless ``check_after`` is False)."""
        raise NotImplementedError

    def vote(self, ok, on_commit=None, meanwhile=None):
        """All-or-nothing: returns True (commit) only if every rank voted ``ok``; then runs
        ``on_commit`` (on every rank alike).  ``meanwhile``: work a rank may do while the
        decision is awaited (used only if it commits)."""
        raise NotImplementedError

    def view(self, handle, dtype, shape):
        """A local numpy view of the buffer ``handle`` (attached on first use)."""
        raise NotImplementedError

    def forget(self, handles):
        """Drop the mappings of buffers the master released."""

    def array(self, ref):
        """The local array of an ``ArrayRef`` (an empty array for a None handle)."""
        if ref.handle is None:
            return np.empty(ref.shape, ref.dtype)
        return self.view(ref.handle, ref.dtype, ref.shape)

    def inputs(self, refs, n_scatter, rows, rank):
        """This rank's rows of a call's scattered inputs (``refs[:n_scatter]``, selected by
        the ``plans.Rows`` ``rows``) and its whole broadcast inputs."""
        index = None if rows.index is None else self.array(rows.index)
        arrays = [self.array(ref) for ref in refs]
        scat = [shards.take_rows(a, rows, rank, mb, index) for a, mb in zip(arrays[:n_scatter], rows.minibatch)]
        return scat, arrays[n_scatter:]

    def close(self):
        pass
