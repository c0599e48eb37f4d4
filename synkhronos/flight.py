"""The flight recorder: what every rank is doing, kept where the master can read it without
the rank's help (a frozen or busy rank cannot answer a message).

Each rank owns a small area of shared memory of its host (``Control.flight_area``): the
command it is in and since when, the collective it is in and since when, what it waits
for (a barrier, a vote, an operation between hosts, ...) and since when, which ranks it
waits for, and a ring of its last ``HISTORY`` commands and collectives with their sizes
and durations.  Writing costs a few integer stores; nothing else is done on the hot path.

The master reads its host's areas directly and asks each other host's agent for a copy of
its host's (``remote``).  ``report()`` puts it in words, for every rank and host; it is
printed with every stall warning, with ``StallTimeout`` / ``WorkerDied`` /
``WorkerStopped``, when the master gets ``SIGUSR1``, and ``synk.session_info().flight``
holds the same records."""
import time
from dataclasses import dataclass
from typing import Optional

HISTORY = 8
# int64 words of a rank's area
PID, SEQ, T_CMD, T_END, VERB, T_VERB, NBYTES, WAIT, T_WAIT, OWED, HEAD = range(11)
_RING = 12                       # then HISTORY entries: seq, verb, nbytes, t_start, seconds
_ENTRY = 5
WORDS = _RING + _ENTRY * HISTORY

VERBS = ("", "all_reduce", "reduce", "broadcast", "all_gatherv", "gatherv", "reduce_scatter", "shapes",
         "barrier", "in-graph program")
WAITS = ("", "the next command", "a barrier", "a vote", "a collective between hosts", "an XLA collective",
         "the channel of this host", "an answer of the master", "the hosts' agents", "replies")
_VERB_ID = {v: i for i, v in enumerate(VERBS)}
_WAIT_ID = {w: i for i, w in enumerate(WAITS)}


class Recorder:
    """One rank's writer: ``q`` and ``d`` view the same memory as int64 and float64."""

    __slots__ = ("q", "d", "clock")

    def __init__(self, q, d, pid):
        self.q, self.d, self.clock = q, d, time.monotonic
        q[PID] = pid

    def command(self, seq):
        self.d[T_CMD] = self.clock()
        self.q[SEQ] = seq
        self.q[VERB] = 0

    def done(self, seq):
        now = self.clock()
        if self.q[VERB]:
            self._ring(now)
        self.d[T_END] = now
        self.q[SEQ] = -seq

    def collective(self, verb, nbytes=0, via=None):
        """Entering ``verb`` (the previous one of the command, if any, goes to the ring);
        ``via``: the comm implementation serving it (kept by the timeline, not the ring)."""
        q = self.q
        now = self.clock()
        if q[VERB]:
            self._ring(now)
        q[VERB] = _VERB_ID.get(verb, 0)
        q[NBYTES] = nbytes
        self.d[T_VERB] = now

    def _ring(self, now):
        q, d = self.q, self.d
        i = _RING + _ENTRY * (q[HEAD] % HISTORY)
        q[i], q[i + 1], q[i + 2] = abs(q[SEQ]), q[VERB], q[NBYTES]
        d[i + 3], d[i + 4] = d[T_VERB], now - d[T_VERB]
        q[HEAD] += 1
        q[VERB] = 0

    def waiting(self, what):
        self.d[T_WAIT] = self.clock()
        self.q[OWED] = 0
        self.q[WAIT] = _WAIT_ID.get(what, len(WAITS)) if what else len(WAITS)

    def owed(self, ranks):
        mask = 0
        for r in ranks:
            if 0 <= r < 63:
                mask |= 1 << r
        self.q[OWED] = mask

    def waited(self):
        self.q[WAIT] = 0


class _Nothing:
    """A recorder that records nothing (a rank without an area)."""

    def command(self, seq):
        pass

    done = command

    def collective(self, verb, nbytes=0, via=None):
        pass

    def waiting(self, what):
        pass

    def owed(self, ranks):
        pass

    def waited(self):
        pass


NOTHING = _Nothing()


def recorder(control, slot, pid):
    """The recorder of the rank in ``slot`` of ``control`` (NOTHING where there is no area)."""
    area = control.flight_area(slot)
    return NOTHING if area is None else Recorder(area[0], area[1], pid)


@dataclass(frozen=True)
class RankFlight:
    """One rank's state as the flight recorder saw it (seconds are ago, on its host)."""
    rank: int
    host: str
    pid: int
    command: int                  # the command it is in (or, negative, the last it finished)
    command_for: float            # seconds in that command (or since it finished it)
    collective: str               # the collective it is in ("" none)
    collective_bytes: int
    collective_for: float
    waiting: str                  # what it waits for ("" nothing)
    waiting_for: float
    waiting_on: tuple             # the ranks it waits for, where known (-1: the other hosts)
    history: tuple                # (command, collective, bytes, seconds) of its last ones, oldest first
    state: str = ""               # its process state where known ("T": stopped)


def read(area, rank, host, now=None):
    """A ``RankFlight`` from a rank's area (``(q, d)`` views)."""
    q, d = area
    now = time.monotonic() if now is None else now
    seq = q[SEQ]
    wait = q[WAIT]
    hist = []
    head = q[HEAD]
    for k in range(max(0, head - HISTORY), head):
        i = _RING + _ENTRY * (k % HISTORY)
        hist.append((q[i], VERBS[q[i + 1]] if 0 <= q[i + 1] < len(VERBS) else "?", q[i + 2], round(d[i + 4], 6)))
    mask = q[OWED]
    return RankFlight(rank, host, q[PID], seq, now - (d[T_CMD] if seq > 0 else d[T_END]),
                      VERBS[q[VERB]] if seq > 0 and 0 <= q[VERB] < len(VERBS) else "", q[NBYTES] if seq > 0 else 0,
                      now - d[T_VERB] if seq > 0 and q[VERB] else 0.0,
                      (WAITS[wait] if wait < len(WAITS) else "the other ranks") if wait else "",
                      now - d[T_WAIT] if wait else 0.0, tuple(r for r in range(63) if mask >> r & 1),
                      tuple(hist))


def describe(f: RankFlight, commands: Optional[dict] = None):
    """One line for one rank: where it is and since when, what it waits for."""
    commands = commands or {}
    where = f"rank {f.rank} ({f.host}, pid {f.pid})"
    if f.state in ("T", "t"):
        where += " STOPPED"
    elif f.state in ("Z", "X", "gone"):
        where += " GONE"
    if f.command > 0:
        text = f"{where}: in command {f.command} ({commands.get(f.command, '?')}) for {f.command_for:.3f} s"
        if f.collective:
            size = f" of {_size(f.collective_bytes)}" if f.collective_bytes else ""
            text += f", in {f.collective}{size} for {f.collective_for:.3f} s"
    elif f.command < 0:
        text = f"{where}: done with command {-f.command} ({commands.get(-f.command, '?')}) {f.command_for:.3f} s ago"
    else:
        text = f"{where}: no command yet"
    if f.waiting:
        text += f"; waiting for {f.waiting} for {f.waiting_for:.3f} s"
        if f.waiting_on:
            who = [str(r) for r in f.waiting_on if r >= 0] + (["the other hosts"] if -1 in f.waiting_on else [])
            text += f", on {'rank(s) ' if who[0][0].isdigit() else ''}{', '.join(who)}"
    return text


def _size(n):
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def report(flights, commands=None, title="synkhronos flight recorder"):
    """Every rank's line, then each rank's last collectives: the text printed on a stall."""
    lines = [f"{title}:"]
    for f in sorted(flights, key=lambda f: f.rank):
        lines.append("  " + describe(f, commands))
    for f in sorted(flights, key=lambda f: f.rank):
        if f.history:
            last = ", ".join(f"{c}:{v}{' ' + _size(b) if b else ''} {s * 1e3:.2f} ms" for c, v, b, s in f.history[-4:])
            lines.append(f"  rank {f.rank} last collectives (command:verb size time): {last}")
    return "\n".join(lines)
