"""How one process waits for others: ``Waiter`` polls a condition, sleeps between looks,
checks that the other side is alive, warns about stalls and raises after a timeout.

Every wait of every plane goes through a ``Waiter``, which owns that policy; the plane
gives it what to look at (``ready``) and how to sleep until woken (``sleep``)."""
import os
import sys
import time

from .errors import StallTimeout
from .flight import NOTHING

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
    KEEP_HOT = 0.0       # then look between yields (not sleeps) this long, checking every tick:
                         # for a process whose messages wake nobody (MPI between hosts)

    def __init__(self, check, stall=DEFAULT_STALL, timeout=None, stream=None, spin=None):
        self.check = check
        self.stall, self.timeout = stall, timeout
        self.stream = stream
        self.spin = self.SPIN if spin is None else spin
        self.service = None          # called at every look (e.g. messages from other hosts)
        self.flight = NOTHING        # the rank's flight recorder: what a long wait waits for, on whom
        self.report = None           # called after each stall warning (the master: the flight report)

    def wait(self, ready, sleep, owed=None, what="command", idle=False, keep_hot=None, hopeless=None):
        """Return once ``ready()`` is true.  ``sleep(t)`` blocks at most ``t`` seconds (or
        until woken); ``owed()`` names the ranks still awaited (for messages); ``hopeless()``,
        looked at every tick, raises when the wait can never end.  For the first
        ``keep_hot`` seconds (default ``KEEP_HOT``) the waits between looks yield the core
        instead of sleeping: an answer that wakes nobody (an MPI message, an MPI operation
        that progresses only while it is tested) is seen at once."""
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
        hot_until = time.perf_counter() + (self.KEEP_HOT if keep_hot is None else keep_hot)
        next_warn = self.stall
        flight = self.flight
        flight.waiting(what)
        try:
            while True:
                if time.perf_counter() < hot_until:
                    if _look(ready, tick):
                        return
                else:
                    sleep(tick)
                    if ready():
                        return
                try:
                    self.check()
                except Exception:   # (an interrupt is never swallowed by an answer that came meanwhile)
                    if ready():     # the answer came just before the loss (a rank's last reply)
                        return
                    raise
                if hopeless is not None:
                    hopeless()
                if idle:
                    continue
                if owed is not None:
                    flight.owed(_owed(owed))
                waited = time.monotonic() - start
                if self.timeout is not None and waited >= self.timeout:
                    raise StallTimeout(_owed(owed), waited, what)
                if next_warn is not None and waited >= next_warn:
                    next_warn += self.stall
                    self._warn(_owed(owed), waited, what)
                    if self.report is not None:
                        self.report()
        finally:
            flight.waited()

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


def _look(ready, seconds):
    """Look at ``ready()`` between yields of the core for up to ``seconds``."""
    end = time.perf_counter() + seconds
    while True:
        if ready():
            return True
        if time.perf_counter() >= end:
            return False
        os.sched_yield()


def _owed(owed):
    try:
        return sorted(owed()) if owed is not None else []
    except Exception:
        return []
