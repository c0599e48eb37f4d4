"""Helpers shared by the fault tests (``test_faults*.py``): the session they fault
(``build``), the checks that a fault ended as documented (``raises_within``,
``assert_died``, ``assert_gone``), a worker out of file descriptors (``choked``), the master
programs of ``_fault_scripts.py`` run in subprocesses (``run_script``), and the times from a
fault to the exception in the master (``record``, ``TIMES``), printed as a table at the end
of each module (``print_times``)."""
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import types
from contextlib import contextmanager

import numpy as np
import pytest
import pytensor
import pytensor.tensor as T

import synkhronos as synk
import synk_testutil as tu
import _fault_ops as fo

N = 3            # ranks 0 (master), 1, 2
VICTIM = 2       # the faulty rank, unless a test says otherwise
BOUND = 10.0     # seconds from a fault to the exception in the master
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fault_scripts.py")

TIMES = []       # (phase, fault, exception, ranks named, seconds)


def print_times(config):
    """Print the rows of TIMES on the terminal as a table, and empty it (the end of a module)."""
    if not TIMES:
        return
    lines = ["", "fault matrix: time from the fault to the exception in the master",
             f"  {'phase':<30} {'fault':<22} {'exception':<34} {'rank':<6} {'seconds':>8}"]
    for phase, fault, exc, ranks, secs in TIMES:
        s = "n/a" if secs is None else f"{secs:8.3f}"
        lines.append(f"  {phase:<30} {fault:<22} {exc:<34} {ranks:<6} {s:>8}")
    TIMES.clear()
    tu.report(config, "\n".join(lines))


@pytest.fixture(scope="module", autouse=True)
def times_table(request):
    """At the end of a module that imports it: its rows of TIMES, as a table on the terminal."""
    yield
    print_times(request.config)


def record(phase, fault, exc, secs):
    if isinstance(exc, synk.RankLost):
        ranks = ",".join(map(str, exc.ranks))
    elif isinstance(exc, synk.WorkerError):
        ranks = ",".join(map(str, exc.ranks))
    elif isinstance(getattr(exc, "__cause__", None), synk.WorkerError):
        ranks = ",".join(map(str, exc.__cause__.ranks))
    else:
        ranks = "-"
    name = type(exc).__name__ if exc is not None else "-"
    if isinstance(getattr(exc, "__cause__", None), synk.WorkerError):
        name += " (from WorkerError)"
    TIMES.append((phase, fault, name, ranks, secs))


# ---- helpers --------------------------------------------------------------------------------

def build(action="raise", when="perform", n=N, distribute=True, **fork_kw):
    """fork(n); ``f``: sum of x through a Fault op (faulty in rank VICTIM); ``fg``: appends
    each rank's shard of x to ``g`` and reads ``w``, ``u`` and ``v`` (so collectives know
    them)."""
    synk.fork(n, **fork_kw)
    x = T.vector("x", dtype="float64")
    w = pytensor.shared(np.zeros(8), name="w")
    u = pytensor.shared(np.zeros((2, 3)), name="u")
    g = pytensor.shared(np.zeros(0), name="g")
    v = pytensor.shared(np.zeros(8), name="v")
    f = synk.function([x], (T.sum(fo.Fault(action, VICTIM, when)(x)), "sum"))
    fg = synk.function([x], [(T.sum(x), "sum"), (T.sum(w) + T.sum(u) + T.sum(v), None)],
                       updates=[(g, T.concatenate([g, x]))])
    if distribute:
        synk.distribute()
    return types.SimpleNamespace(prefix=tu.prefix(), f=f, fg=fg, x=x, w=w, u=u, g=g, v=v, n=n,
                                 pids=tu.worker_pids())


def assert_gone(prefix, pids=(), timeout=5.0):
    """No process of ``pids`` alive, no worker child, no /dev/shm entry of ``prefix``."""
    assert tu.wait_until(lambda: not any(tu.pid_running(p) for p in pids), timeout), \
        f"worker processes still running: {[p for p in pids if tu.pid_running(p)]}"
    assert tu.wait_until(lambda: not tu.worker_children(), timeout), tu.worker_children()
    assert tu.wait_until(lambda: not tu.shm_entries(prefix), timeout), tu.shm_entries(prefix)


def assert_died(exc, rank, what=None):
    assert isinstance(exc, synk.WorkerDied), repr(exc)
    assert exc.rank == rank and exc.returncode == -signal.SIGKILL
    msg = str(exc)
    assert f"rank {rank}" in msg and "killed by signal 9" in msg
    if what:
        assert what in msg


def lowest_free_fd(pid):
    fds = {int(x) for x in os.listdir(f"/proc/{pid}/fd")}
    i = 0
    while i in fds:
        i += 1
    return i


@contextmanager
def choked(rank):
    """Worker ``rank`` cannot open any more file descriptors (so no new shared-memory
    segment) while inside the block."""
    pid = tu.pid_of(rank)
    old = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (lowest_free_fd(pid), old[1]))
    try:
        yield
    finally:
        try:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, old)
        except ProcessLookupError:       # it died of it
            pass


def raises_within(fn, exc_types=(Exception,)):
    """Run ``fn``; return (exception, seconds).  Fails if nothing is raised or if it takes
    more than BOUND."""
    t0 = time.monotonic()
    try:
        fn()
    except exc_types as e:
        dt = time.monotonic() - t0
        assert dt < BOUND, f"the exception took {dt:.1f} s"
        return e, dt
    pytest.fail("no exception was raised")


def run_script(*args, kill_after=None, timeout=60, env=None):
    """Start ``_fault_scripts.py ARGS`` in its own session; return (info, result, output,
    returncode, seconds from the kill to the process's end).  With ``kill_after`` the master
    is SIGKILLed that many seconds after it reported its session."""
    proc = subprocess.Popen([sys.executable, SCRIPT, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True, env=None if env is None else {**os.environ, **env})
    info = result = None
    lines = []
    t_kill = None
    guard = threading.Timer(timeout, proc.kill)       # whatever happens, no hang here
    guard.start()
    try:
        deadline = time.monotonic() + timeout
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("SYNK-INFO "):
                info = json.loads(line[len("SYNK-INFO "):])
                if kill_after is not None:
                    time.sleep(kill_after)
                    t_kill = time.monotonic()
                    proc.kill()
                    break
            elif line.startswith("SYNK-RESULT "):
                result = json.loads(line[len("SYNK-RESULT "):])
            if time.monotonic() > deadline:
                break
        proc.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        guard.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if info is not None:
            for p in info["pids"]:               # never leave anything behind, even on failure
                if tu.pid_running(p) and not tu.wait_until(lambda: not tu.pid_running(p), 10):
                    os.kill(p, signal.SIGKILL)
    return info, result, "".join(lines), proc.returncode, t_kill
