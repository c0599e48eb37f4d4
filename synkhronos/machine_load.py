"""How busy the machine is apart from this job: the share of the CPU that other programs use
(``/proc/stat`` minus this process and its ranks) and the load average.

Why: the demos and benchmarks time data-parallel runs against one process with
multithreaded BLAS, which slows down up to ~10x when another program holds one of its
cores.  They measure the other programs' load just before, during and just after their
timed runs, to say when a speedup is unreliable.  Linux only (``/proc``); elsewhere every
measurement is None.  Not part of the training API (not in ``synkhronos.__all__``)."""
import os
import time

BUSY = 0.10            # other programs' share of the CPU above which timings are unreliable

_LAUNCHERS = ("mpiexec", "mpiexec.hydra", "mpirun", "hydra_pmi_proxy", "orted", "prterun", "prted")


def _proc_stat():
    """(busy, total) CPU ticks of the whole machine since boot (Linux ``/proc/stat``)."""
    with open("/proc/stat") as f:
        v = [int(t) for t in f.readline().split()[1:9]]     # user .. steal (guest is in user)
    return sum(v) - v[3] - v[4], sum(v)


def _job_root(procs, me):
    """This process, or under an MPI launcher on this machine the launcher: its tree holds
    every process of the job here (with simulated hosts, the other hosts' ranks too)."""
    root, pid = me, procs.get(me, (0, 0, ""))[0]
    while pid in procs and procs[pid][2] in _LAUNCHERS:
        root, pid = pid, procs[pid][0]
    return root


def _own_ticks():
    """CPU ticks of this process and all its descendants (the ranks), or of the whole MPI
    job when an MPI launcher started it."""
    me, procs = os.getpid(), {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                s = f.read()
            rest = s[s.rindex(")") + 2:].split()
            # after the name: state ppid ... utime(11) stime(12) cutime(13) cstime(14)
            procs[int(name)] = (int(rest[1]), sum(int(t) for t in rest[11:15]), s[s.index("(") + 1:s.rindex(")")])
        except (OSError, ValueError, IndexError):
            continue                         # gone meanwhile
    kids = {}
    for pid, (ppid, _, _) in procs.items():
        kids.setdefault(ppid, []).append(pid)
    total, todo = 0, [_job_root(procs, me)]
    while todo:
        pid = todo.pop()
        if pid in procs:
            total += procs[pid][1]
        todo.extend(kids.get(pid, ()))
    return total


class MachineLoad:
    """The share of the machine's CPU (0..1, all cores) busy between creation and
    :meth:`share`, whoever used it (this job included).  None where ``/proc`` is missing."""

    def __init__(self):
        self._start = self._sample()

    def _sample(self):
        """(busy, total) CPU ticks so far, or None."""
        try:
            return _proc_stat()
        except (OSError, ValueError, IndexError):
            return None

    def share(self):
        now = self._sample() if self._start is not None else None
        if now is None:
            return None
        (b0, t0), (b1, t1) = self._start, now
        if t1 <= t0:
            return None
        return min(1.0, max(0.0, (b1 - b0) / (t1 - t0)))


class OtherLoad(MachineLoad):
    """The share of the machine's CPU (0..1, all cores) that programs other than this one and
    its ranks used between creation and :meth:`share`.  None where ``/proc`` is missing."""

    def _sample(self):
        try:
            busy, total = _proc_stat()
            return busy - _own_ticks(), total
        except (OSError, ValueError, IndexError):
            return None


def machine_busy(seconds=0.5):
    """Share of all cores that other programs use over ``seconds`` (this process and its
    ranks, idle meanwhile, excluded), or None where it cannot be measured."""
    m = OtherLoad()
    time.sleep(seconds)
    return m.share()


def load_average():
    """The 1-minute load average, or None where ``/proc/loadavg`` cannot be read."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def percent(share):
    """``"45%"``, or ``"?"`` for an unknown share (None)."""
    return "?" if share is None else f"{100 * share:.0f}%"


def load_verdict(before, during, after, la0, la1):
    """(line describing the load, caveat for the RESULT line or ""): ``before``, ``during``
    and ``after`` the timed runs, other programs' shares (or None); ``la0``, ``la1``, the
    load average before and after (or None)."""
    la = "" if la0 is None or la1 is None else f"; load average {la0:.2f} -> {la1:.2f}"
    line = (f"other programs' CPU use (share of all cores): {percent(before)} just before, "
            f"{percent(during)} during, {percent(after)} just after the timed runs{la}")
    known = [x for x in (before, during, after) if x is not None]
    if not known:
        return line + " (not measurable here)", ""
    worst = max(known)
    if worst < BUSY:
        return line, ""
    caveat = (f" | CAUTION: speedups unreliable: other programs used up to {percent(worst)} of "
              f"the CPU around the timed runs ({percent(during)} during them{la}); multithreaded "
              f"BLAS, which the all-cores baseline relies on, slows down up to ~10x when another "
              f"program holds one of its cores, so these ratios can be off several-fold either "
              f"way; rerun on an idle machine")
    return line, caveat
