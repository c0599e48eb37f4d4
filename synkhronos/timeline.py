"""A timeline of every rank: a Chrome / Perfetto trace (``chrome://tracing``,
https://ui.perfetto.dev) written when the session closes.

``synk.fork(timeline="run.json")`` (or env ``SYNK_TIMELINE``) turns it on.  Each rank is
one process of the trace, named with its rank, host and pid; its events are spans on one
track, nested by time:

* every command (``call of function f``, ``all_reduce``, ``distribute`` ...), with its
  sequence number;
* inside it, every collective with its bytes and the implementation that served it
  (``via``: ``shm``, ``hier`` between hosts, ``xla`` for NCCL, ``staged`` through the host;
  the staged path's adds on a device as a span of their own), and every wait for other ranks (a barrier,
  a vote, the next command, replies) with the ranks it waited on: a straggler is the rank
  the others' waits point at, and whose own span is the long one;
* compiles and cache loads (``compile``), where the rank compiled a function.

What is between a command's nested spans is the rank's own work (computing, moving its
rows).  The events are the flight recorder's (``synkhronos.flight``), kept in each
process while the timeline is on, and nothing more when it is off: the last
``SYNK_TIMELINE_EVENTS`` of them (default 200000, about 40000 commands and 60 MB a rank),
so that a long run's memory stays bounded; a trace that lost its oldest events says how
many in each rank's name.  Workers hand
theirs to the master in their reply to the session's last command (through the control
plane: from every host under ``mpiexec`` too); the master merges them, names the commands
from its log and writes the file (mode 0600, through a temporary name).  A session that
loses a rank writes the events of the ranks that answered.  Times are each host's wall
clock: ranks of different machines line up as well as their clocks agree (NTP: typically
well under a millisecond on a LAN)."""
import collections
import json
import os
import secrets
import time

DEFAULT_EVENTS = 200_000
_current = None


class Timeline:
    """This process's last ``limit`` events: ``(name, category, start, end, args)``,
    wall-clock seconds."""

    def __init__(self, rank, host, pid, limit=DEFAULT_EVENTS):
        self.rank, self.host, self.pid, self.limit = rank, host, pid, limit
        self.events = collections.deque(maxlen=limit)
        self.recorded = 0
        self.labels = {}                 # seq -> what the command was (the master's; the last ``limit``)

    def span(self, name, cat, t0, t1, args=None):
        self.events.append((name, cat, t0, t1, args))
        self.recorded += 1

    def label(self, seq, what):
        self.labels[seq] = what
        if len(self.labels) > self.limit:
            del self.labels[next(iter(self.labels))]

    def handed(self):
        """What the trace needs of this process's events."""
        return {"rank": self.rank, "host": self.host, "pid": self.pid, "events": list(self.events),
                "dropped": self.recorded - len(self.events)}


def event_limit():
    """``SYNK_TIMELINE_EVENTS`` (a positive int), else ``DEFAULT_EVENTS``."""
    raw = os.environ.get("SYNK_TIMELINE_EVENTS", "").strip()
    if not raw:
        return DEFAULT_EVENTS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"SYNK_TIMELINE_EVENTS must be a positive number of events a rank keeps, got {raw!r}")
    return value


def start(rank, host, limit=None):
    """Turn the timeline on in this process, keeping its last ``limit`` events (default:
    ``event_limit()``)."""
    global _current
    _current = Timeline(rank, host, os.getpid(), limit or event_limit())
    return _current


def stop():
    global _current
    tl, _current = _current, None
    return tl


def current():
    return _current


class Recording:
    """A flight recorder that also keeps spans for the timeline (see ``flight.Recorder``:
    the same calls, made at the same places)."""

    def __init__(self, inner, tl):
        self.inner, self.tl, self.clock = inner, tl, time.time     # (wall clock: hosts agree on it)
        self.seq, self.t_cmd = 0, None
        self.verb, self.nbytes, self.via, self.t_verb = None, 0, None, None
        self.what, self.t_wait, self.on = None, None, ()

    def command(self, seq):
        self.inner.command(seq)
        self.seq, self.t_cmd = seq, self.clock()

    def done(self, seq):
        self.inner.done(seq)
        now = self.clock()
        self._end_collective(now)
        if self.t_cmd is not None:
            self.tl.span(f"command {seq}", "command", self.t_cmd, now, {"seq": seq})
            self.t_cmd = None

    def collective(self, verb, nbytes=0, via=None):
        self.inner.collective(verb, nbytes)
        now = self.clock()
        self._end_collective(now)
        self.verb, self.nbytes, self.via, self.t_verb = verb, nbytes, via, now

    def _end_collective(self, now):
        if self.verb is not None:
            self.tl.span(self.verb, "collective", self.t_verb, now,
                         {"bytes": self.nbytes, "command": self.seq, "via": self.via})
            self.verb = None

    def waiting(self, what):
        self.inner.waiting(what)
        self.what, self.t_wait, self.on = what, self.clock(), ()

    def owed(self, ranks):
        self.inner.owed(ranks)
        self.on = tuple(ranks)

    def waited(self):
        self.inner.waited()
        if self.t_wait is not None:
            args = {"command": self.seq}
            if self.on:
                args["waiting on ranks"] = list(self.on)
            self.tl.span(f"wait: {self.what or 'other ranks'}", "wait", self.t_wait, self.clock(), args)
            self.t_wait = None


def compile_span(name, t0, t1):
    """A compile or cache load of function ``name`` in this process (if the timeline is on)."""
    if _current is not None:
        _current.span(f"compile {name}", "compile", t0, t1)


# ---- the trace ------------------------------------------------------------------------------

def take():
    """This process's events, as a worker hands them to the master when the session closes
    (the reply to its last command: through the control plane, from any host)."""
    tl = stop()
    return None if tl is None else tl.handed()


def missing(n, master_rank, workers):
    """The ranks of ``n`` (other than the master's) whose events are not in ``workers``."""
    got = {w["rank"] for w in workers if isinstance(w, dict) and "events" in w}
    return sorted(set(range(n)) - got - {master_rank})


def write_trace(path, workers):
    """Merge the master's events with the workers' (``take()`` of each, None where a rank
    sent none) into a Chrome trace at ``path``.  Returns the path, or None when the
    timeline was off."""
    tl = stop()
    if tl is None:
        return None
    ranks = [tl.handed()] + [w for w in workers if isinstance(w, dict) and "events" in w]
    t0 = min((e[2] for r in ranks for e in r["events"]), default=0.0)
    trace = []
    for r in sorted(ranks, key=lambda r: r["rank"]):
        pid = r["rank"]
        lost = r.get("dropped", 0)
        lost = f", its first {lost} events dropped (SYNK_TIMELINE_EVENTS)" if lost else ""
        trace.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                      "args": {"name": f"rank {r['rank']} ({r['host']}, pid {r['pid']}{lost})"}})
        trace.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for name, cat, a, b, args in r["events"]:
            if cat == "command":
                name = tl.labels.get((args or {}).get("seq")) or name
            trace.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": 0,
                          "ts": (a - t0) * 1e6, "dur": max(0.0, b - a) * 1e6, "args": args or {}})
    _write_private(os.fspath(path), {"traceEvents": trace, "displayTimeUnit": "ms"})
    return path


def _write_private(path, obj):
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)
