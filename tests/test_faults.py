"""Fault matrix: a worker killed (SIGKILL) or raising, at every phase; the master killed;
Ctrl-C in the master.  Every fault must end in an exception in the master within
``BOUND`` seconds that names the rank, after which ``close()`` works and no process and no
/dev/shm entry of the session remains.

How faults are caused (no monkeypatching of synkhronos):

* fork: a ``sitecustomize`` on the workers' PYTHONPATH makes one rank SIGKILL itself, or
  makes its ``import pytensor`` fail (``_fault_scripts.startup_fault_env``);
* distribute: a test Op (``_fault_scripts.Fault``) whose unpickling in one rank raises or
  SIGKILLs that process;
* function calls: the same Op raising / SIGKILLing in one rank, only when that rank's shard
  holds a trigger value (with and without ``num_slices``);
* worker-side exceptions in Data handling and collectives: the worker runs out of file
  descriptors (``prlimit`` on that process: the machine refusing resources), so the
  shared-memory segment it must open next fails with EMFILE; for reductions, a shape that
  differs in one rank; a Data segment removed from /dev/shm behind the runtime's back;
* kills during collectives: the victim is stopped (SIGSTOP) so the command is surely in
  flight when it is SIGKILLed 0.3 s later.

Documented outcomes: a worker's exception -> WorkerError (or, where every rank sees the
problem, the master's own exception chained from the WorkerError), the runtime stays
usable; a dead worker -> WorkerDied, the runtime is closed (the time includes the ~0.2 s
the runtime gives the other workers before killing them); Ctrl-C -> KeyboardInterrupt, the
runtime stays usable and the next command first collects the interrupted one.

The times (from the fault to the exception in the master) are printed as a table on the
terminal at the end of the module."""
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
import _fault_scripts as fs

fs.quiet()
pytestmark = pytest.mark.filterwarnings("ignore:Numba will use object mode")

N = 3            # ranks 0 (master), 1, 2
VICTIM = 2       # the faulty rank, unless a test says otherwise
BOUND = 10.0     # seconds from a fault to the exception in the master
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_fault_scripts.py")

TIMES = []       # (phase, fault, exception, ranks named, seconds)


@pytest.fixture(scope="module", autouse=True)
def _print_times(request):
    yield
    if not TIMES:
        return
    lines = ["", "fault matrix: time from the fault to the exception in the master",
             f"  {'phase':<30} {'fault':<22} {'exception':<34} {'rank':<6} {'seconds':>8}"]
    for phase, fault, exc, ranks, secs in TIMES:
        s = "n/a" if secs is None else f"{secs:8.3f}"
        lines.append(f"  {phase:<30} {fault:<22} {exc:<34} {ranks:<6} {s:>8}")
    fs.report(request.config, "\n".join(lines))


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
    f = synk.function([x], (T.sum(fs.Fault(action, VICTIM, when)(x)), "sum"))
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


def starved(s, fn, rank=VICTIM):
    """``fn`` run while worker ``rank`` is out of file descriptors."""
    def run():
        with choked(rank):
            fn()
    return run


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


def grow_g(s):
    """Make every rank's live ``g`` (updated by fg) larger than its collective slot."""
    cur = len(s.g.get_value())
    rows = s.n * (2 * cur + 100)
    s.fg(np.ones(rows))


# ==============================================================================================
# Exceptions raised inside a worker, in one session (the runtime stays usable after each)

@pytest.fixture(scope="class")
def S():
    try:
        s = build("raise")
        s.fg(np.arange(9.0))
        s.size = 100
        yield s
    finally:
        synk.close()


def sane(S):
    """The session still computes correctly (and its collectives agree on every rank)."""
    assert S.f(np.arange(9.0)) == 36.0
    assert S.f(np.arange(9.0), num_slices=2) == 36.0
    v = np.linspace(-1, 1, 8)
    synk.broadcast(S.w, v)
    np.testing.assert_array_equal(synk.gather(S.w), np.stack([v] * S.n))
    synk.all_reduce(S.w, op="sum")
    np.testing.assert_allclose(synk.gather(S.w), np.stack([v * S.n] * S.n))


class TestWorkerRaises:

    def check(self, S, phase, fn, ranks=(VICTIM,), fault="raise", match=None):
        e, dt = raises_within(fn)
        record(phase, fault, e, dt)
        err = e if isinstance(e, synk.WorkerError) else e.__cause__
        assert isinstance(err, synk.WorkerError), repr(e)
        # when several ranks fail, the first one aborts the command: the others may report
        # "aborted" instead of their own error, so at least one of the expected ranks is named
        assert err.ranks and set(err.ranks) <= set(ranks), (err.ranks, ranks)
        for r in err.ranks:
            assert f"rank {r}" in str(err) and "Traceback" in err.errors[r]
            if match:
                assert match in err.errors[r], err.errors[r]
        assert tu.is_open()
        sane(S)
        return e

    def test_sane(self, S):
        sane(S)

    def test_call(self, S):
        e = self.check(S, "call", lambda: S.f(fs.with_trigger(np.ones(9), VICTIM, N)),
                       match="FaultInjected")
        assert "synk-fault injected in rank 2 at perform" in str(e)

    def test_call_sliced(self, S):
        self.check(S, "call num_slices=3", lambda: S.f(fs.with_trigger(np.ones(30), VICTIM, N),
                                                         num_slices=3), match="FaultInjected")

    def test_call_in_master_and_worker(self, S):
        v = fs.with_trigger(np.ones(9), VICTIM, N)
        v[0] = fs.TRIGGER        # the master's own Fault op never fires: only rank 2 fails
        self.check(S, "call (trigger in 2 shards)", lambda: S.f(v), match="FaultInjected")

    def test_data_allocation(self, S):
        d = synk.data(np.ones(9))                   # master only: a new segment
        self.starved_check(S, "Data allocation", lambda: S.f(d))
        assert S.f(d) == 9.0                        # the worker attaches it now

    def test_data_resize(self, S):
        d = synk.data(np.ones(9))
        assert S.f(d) == 9.0
        d.set_value(np.ones(3000))                  # a larger segment
        self.starved_check(S, "Data resize", lambda: S.f(d))
        assert S.f(d) == 3000.0

    def test_data_segment_removed_behind_our_back(self, S):
        """Someone removes a Data's segment from /dev/shm before the workers map it: every
        worker reports it; a reallocation (new segment) repairs the Data."""
        d = synk.data(np.ones(9))
        os.unlink(tu.backing_file(d.data))
        self.check(S, "Data segment removed", lambda: S.f(d), ranks=(1, 2), fault="unlinked",
                   match="ExistentialError")
        d.set_value(np.ones(5))                     # fits the allocation: same (gone) segment
        with pytest.raises(synk.WorkerError):
            S.f(d)
        d.set_value(np.ones(5000))                  # a new segment
        assert S.f(d) == 5000.0

    def _bigger(self, S):
        S.size *= 2
        return S.size

    def starved_check(self, S, phase, fn):
        return self.check(S, phase, starved(S, fn), fault="EMFILE", match="maximum number of files")

    def test_broadcast(self, S):
        v = np.full(self._bigger(S), 3.0)
        self.starved_check(S, "broadcast", lambda: synk.broadcast(S.w, v))

    def test_broadcast_split(self, S):
        v = np.full(max(self._bigger(S), 200_000), 3.0)     # >= 1 MB: chunked copy
        S.size = len(v)
        self.starved_check(S, "broadcast (>= 1 MB)", lambda: synk.broadcast(S.w, v))

    def test_scatter(self, S):
        v = np.arange(float(self._bigger(S)) * N)
        self.starved_check(S, "scatter", lambda: synk.scatter(S.w, v))

    def test_set_value(self, S):
        v = np.arange(float(self._bigger(S)))
        self.starved_check(S, "set_value(rank 2)", lambda: synk.set_value(VICTIM, S.w, v))

    def test_gather(self, S):
        grow_g(S)
        self.starved_check(S, "gather", lambda: synk.gather(S.g))

    def test_get_value(self, S):
        grow_g(S)
        while synk.get_lengths(S.g)[VICTIM] * 8 < (1 << 18):   # beyond its reply mailbox so far
            grow_g(S)
        self.starved_check(S, "get_value(rank 2)", lambda: synk.get_value(VICTIM, S.g))

    def test_all_gather(self, S):
        grow_g(S)
        before = [synk.get_value(r, S.g) for r in range(N)]
        self.starved_check(S, "all_gather", lambda: synk.all_gather(S.g))
        for r in range(N):                          # nothing changed
            np.testing.assert_array_equal(synk.get_value(r, S.g), before[r])

    @pytest.mark.parametrize("op", ["all_reduce", "reduce", "reduce_result"])
    def test_reductions_shape_differs_in_one_rank(self, S, op):
        vals = [np.full((2, 3), float(r + 1)) for r in range(N)]
        vals[VICTIM] = np.full((2, 4), 7.0)
        for r in range(N):
            synk.set_value(r, S.u, vals[r])
        run = {"all_reduce": lambda: synk.all_reduce(S.u, op="sum"),
               "reduce": lambda: synk.reduce(S.u, op="sum"),
               "reduce_result": lambda: synk.reduce(S.u, op="sum", in_place=False)}[op]
        # every rank sees the mismatch: the master raises ValueError from the workers' errors
        e = self.check(S, f"{op} (shape differs)", run, ranks=(1, 2), fault="shape")
        assert isinstance(e, ValueError)
        assert "[(2, 3), (2, 3), (2, 4)] (by rank)" in str(e)
        for r in range(N):                          # the variables are as they were
            np.testing.assert_array_equal(synk.get_value(r, S.u), vals[r])

    def test_get_shapes_has_no_worker_side_failure(self, S):
        # get_shapes only reads a shape in the workers: nothing there can fail; a kill is
        # covered below.
        TIMES.append(("get_shapes / get_lengths", "raise", "(cannot fail in a worker)", "-", None))
        sane(S)
        assert synk.get_shapes(S.w) == [(8,)] * N

    @pytest.mark.parametrize("op", ["all_reduce", "reduce", "broadcast", "broadcast_split"])
    def test_failed_collective_is_all_or_nothing(self, S, op):
        """One rank cannot get the memory it needs: the collective raises, and every rank,
        the master included, keeps its old value (nobody got the new one)."""
        n = N
        # sizes grow from case to case, so that v's slots must regrow (new segments) each time
        # (large values: small ones travel through an area mapped once, where nothing can fail)
        m, big = {"all_reduce": (4096, 32768), "reduce": (8192, 65536), "broadcast": (512, 20_000),
                  "broadcast_split": (100_000, 400_000)}[op]
        for r in range(n):
            synk.set_value(r, S.v, np.full(m, float(r + 1)))
        synk.all_reduce(S.v, op="sum")          # every rank has attached every slot
        if op.startswith("broadcast"):
            synk.set_value(VICTIM, S.v, np.zeros(m))       # its slot must grow for `new`
            before = [synk.get_value(r, S.v) for r in range(n)]
            new = np.arange(float(big))
            run = lambda: synk.broadcast(S.v, new)         # noqa: E731
        else:
            before = [np.full(big, float(r + 1)) for r in range(n)]
            for r in range(n):                  # slots regrow: new segments to attach
                synk.set_value(r, S.v, before[r])
            run = (lambda: synk.all_reduce(S.v, op="sum")) if op == "all_reduce" \
                else (lambda: synk.reduce(S.v, op="sum"))
        with choked(VICTIM):
            with pytest.raises(synk.WorkerError) as ei:
                run()
        assert ei.value.ranks == [VICTIM]
        after = [synk.get_value(r, S.v) for r in range(n)]
        try:
            for r in range(n):
                assert np.array_equal(after[r], before[r]), f"rank {r} changed"
        finally:
            sane(S)

    def test_zz_close_leaves_nothing(self, S):
        """Last in the class: after all those faults, close() works and leaves nothing."""
        sane(S)
        synk.close()
        assert synk.session_info() is None
        assert_gone(S.prefix, S.pids.values())


# ==============================================================================================
# Exceptions at fork and distribute (sessions of their own)

STARTS = [pytest.param(True, id="forked"), pytest.param(False, id="spawned")]   # (see forked.py)


@pytest.mark.parametrize("forked", STARTS)
def test_fork_worker_raises(tmp_path, monkeypatch, forked):
    for k, v in fs.startup_fault_env(tmp_path, f"raise:{VICTIM}", forked).items():
        monkeypatch.setenv(k, v)
    first = len(tu.prefixes())
    e, dt = raises_within(lambda: synk.fork(N))
    monkeypatch.undo()
    record("fork", "raise", e, dt)
    # WorkerError with the traceback, or WorkerDied (exit code 1) when it died before replying
    assert isinstance(e, (synk.WorkerError, synk.WorkerDied))
    assert f"rank {VICTIM}" in str(e) and "start-up" in str(e)
    if isinstance(e, synk.WorkerError):
        assert e.ranks == [VICTIM] and ("floatX" if not forked else "import of pytensor") in e.errors[VICTIM]
    else:
        assert e.rank == VICTIM and e.returncode == 1
    assert synk.session_info() is None
    synk.close()
    assert_gone(tu.prefixes()[first])


@pytest.mark.parametrize("forked", STARTS)
def test_fork_worker_raises_keeps_traceback(tmp_path, monkeypatch, forked):
    # rank 1 starts late, so rank 2 has surely failed and exited while the master waits
    for k, v in fs.startup_fault_env(tmp_path, f"raise:{VICTIM},sleep:1:1.5", forked).items():
        monkeypatch.setenv(k, v)
    first = len(tu.prefixes())
    try:
        with pytest.raises(synk.SynkError) as ei:
            synk.fork(N)
    finally:
        monkeypatch.undo()
        synk.close()
        assert_gone(tu.prefixes()[first])
    e = ei.value
    assert f"rank {VICTIM}" in str(e)
    assert isinstance(e, synk.WorkerError)
    assert ("floatX" if not forked else "import of pytensor") in e.errors[VICTIM]


def test_fork_server_that_cannot_start_leaves_workers_spawned(tmp_path, monkeypatch):
    """The fork server dies as it starts: the session starts anyway (its workers spawned),
    works, and ends clean; the next session too."""
    for k, v in fs.startup_fault_env(tmp_path, "server").items():
        monkeypatch.setenv(k, v)
    try:
        for _ in range(2):
            s = build()
            assert s.fg(np.arange(9.0))[0] == 36.0
            synk.close()
            assert_gone(s.prefix, s.pids.values())
    finally:
        monkeypatch.undo()
        synk.close()


def test_distribute_worker_raises_at_unpickle():
    try:
        s = build("raise", when="unpickle", distribute=False)
        e, dt = raises_within(synk.distribute)
        record("distribute", "raise", e, dt)
        assert isinstance(e, synk.WorkerError) and e.ranks == [VICTIM]
        assert "synk-fault injected in rank 2 at unpickle" in e.errors[VICTIM]
        assert "during distribute" in str(e)
        # documented: the session stays open but undistributed; calls say so
        assert tu.is_open() and not tu.info().distributed
        with pytest.raises(RuntimeError, match="distribute"):
            s.f(np.ones(3))
        synk.close()
        assert_gone(s.prefix, s.pids.values())
    finally:
        synk.close()


def test_worker_that_cannot_read_a_command_reports_it():
    """A worker short of file descriptors when the distribute payload arrives (a new,
    larger mailbox segment): a WorkerError naming it, and distribute() can be retried."""
    try:
        s = build("raise", distribute=False)
        with choked(VICTIM):
            e, dt = raises_within(synk.distribute)
        assert f"rank {VICTIM}" in str(e)
        assert isinstance(e, synk.WorkerError), repr(e)
        synk.distribute()
        assert s.f(np.arange(9.0)) == 36.0
    finally:
        synk.close()


# ==============================================================================================
# SIGKILL of a worker at every phase (each cell closes its runtime)

@pytest.mark.parametrize("forked", STARTS)
def test_fork_worker_killed(tmp_path, monkeypatch, forked):
    for k, v in fs.startup_fault_env(tmp_path, f"kill:{VICTIM}", forked).items():
        monkeypatch.setenv(k, v)
    first = len(tu.prefixes())
    e, dt = raises_within(lambda: synk.fork(N))
    monkeypatch.undo()
    record("fork", "SIGKILL", e, dt)
    assert_died(e, VICTIM, "start-up")
    assert synk.session_info() is None
    synk.close()
    assert_gone(tu.prefixes()[first])


def test_distribute_worker_killed_at_unpickle():
    try:
        s = build("kill", when="unpickle", distribute=False)
        e, dt = raises_within(synk.distribute)
        record("distribute", "SIGKILL", e, dt)
        assert_died(e, VICTIM, "distribute")
        assert synk.session_info() is None
        synk.close()
        assert_gone(s.prefix, s.pids.values())
    finally:
        synk.close()


def test_data_worker_killed():
    """Data allocation and resizing are master-only: a worker killed meanwhile is reported
    by the next command that involves the workers (here the call using the Data)."""
    try:
        s = build("kill")
        d = synk.data(np.ones(9))
        assert s.f(d) == 9.0
        tu.kill_rank(VICTIM)
        t0 = time.monotonic()
        d2 = synk.data(np.ones(12))                 # a new Data
        d.set_value(np.ones(5000))                  # a reallocation
        d.set_shape((20,))                          # a shrink within the allocation
        e, dt = raises_within(lambda: s.f(d2))
        record("Data alloc/resize", "SIGKILL", e, time.monotonic() - t0)
        assert_died(e, VICTIM, "call")
        synk.close()
        assert_gone(s.prefix, s.pids.values())
        with pytest.raises(RuntimeError, match="closed"):
            d.set_value(np.ones(3))
    finally:
        synk.close()


@pytest.mark.parametrize("num_slices", [1, 3])
def test_call_worker_killed(num_slices):
    try:
        s = build("kill")
        assert s.f(np.arange(9.0)) == 36.0
        e, dt = raises_within(lambda: s.f(fs.with_trigger(np.ones(30), VICTIM, N),
                                          num_slices=num_slices))
        record(f"call num_slices={num_slices}", "SIGKILL", e, dt)
        assert_died(e, VICTIM, "call")
        assert synk.session_info() is None
        synk.close()
        assert_gone(s.prefix, s.pids.values())
    finally:
        synk.close()


COLLECTIVES = {
    "broadcast": lambda s: synk.broadcast(s.w, np.ones(8)),
    "broadcast (>= 1 MB)": lambda s: synk.broadcast(s.w, np.ones(200_000)),
    "scatter": lambda s: synk.scatter(s.w, np.arange(30.0)),
    "gather": lambda s: synk.gather(s.w),
    "all_gather": lambda s: synk.all_gather(s.w),
    "reduce": lambda s: synk.reduce(s.w, op="sum"),
    "reduce (in_place=False)": lambda s: synk.reduce(s.w, op="max", in_place=False),
    "all_reduce": lambda s: synk.all_reduce(s.w, op="sum"),
    "set_value(rank 2)": lambda s: synk.set_value(VICTIM, s.w, np.ones(8)),
    "get_value(rank 2)": lambda s: synk.get_value(VICTIM, s.w),
    "get_shapes": lambda s: synk.get_shapes(s.w),
    "get_lengths": lambda s: synk.get_lengths(s.w),
}


@pytest.mark.parametrize("name", list(COLLECTIVES))
def test_collective_worker_killed_in_flight(name):
    """The victim is stopped before the collective starts and killed 0.3 s into it."""
    run = COLLECTIVES[name]
    killer = None
    try:
        s = build("kill")
        s.fg(np.arange(9.0))
        run(s)                                       # works, and is warm
        victim = tu.pid_of(VICTIM)
        os.kill(victim, signal.SIGSTOP)
        t_kill = []
        killer = threading.Timer(0.3, lambda: (t_kill.append(time.monotonic()), os.kill(victim, signal.SIGKILL)))
        killer.start()
        e, dt = raises_within(lambda: run(s))
        detect = time.monotonic() - t_kill[0]
        record(name, "SIGKILL in flight", e, detect)
        assert_died(e, VICTIM)
        assert dt >= 0.25                            # it was waiting for the stopped rank
        assert synk.session_info() is None
        synk.close()
        assert_gone(s.prefix, s.pids.values())
    finally:
        if killer is not None:
            killer.cancel()
        synk.close()


# ==============================================================================================
# Workers killed between commands, and while a call waits for them

def test_killed_worker_raises_workerdied_then_fork_again(assert_clean):
    from test_failures import CRASH_DEADLINE, X, Y, _g1_graph, _g1_ref
    try:
        synk.fork(3)
        x, y, z = _g1_graph()
        f = synk.function([x], z, bcast_inputs=[y])
        synk.distribute()
        assert np.isclose(f(X, Y), _g1_ref(X, Y), rtol=1e-5)
        prefix = tu.prefix()
        pids = tu.worker_pids()
        assert sorted(pids) == [1, 2]
        assert tu.shm_entries(prefix)
        os.kill(pids[1], signal.SIGKILL)
        assert tu.wait_until(lambda: not tu.pid_running(pids[1]), 5.0)

        t0 = time.monotonic()
        with pytest.raises(synk.WorkerDied) as ei:
            f(X, Y)
        assert time.monotonic() - t0 < CRASH_DEADLINE
        e = ei.value
        assert e.rank == 1 and e.returncode == -signal.SIGKILL
        assert "rank 1" in str(e) and "fork" in str(e)
        # the runtime closed itself: the other worker is gone too, and every segment
        assert synk.session_info() is None
        assert tu.wait_until(lambda: not tu.pid_running(pids[2]), 5.0)
        assert tu.shm_entries(prefix) == []
        assert tu.worker_children() == []
        with pytest.raises(RuntimeError):
            f(X, Y)
        synk.close()                               # harmless after a crash

        # fork works again
        assert synk.fork(2) == 2
        x, y, z = _g1_graph()
        f2 = synk.function([x], z, bcast_inputs=[y])
        synk.distribute()
        assert np.isclose(f2(X, Y), _g1_ref(X, Y), rtol=1e-5)
        synk.close()
    finally:
        synk.close()
    assert_clean()


def test_killed_worker_while_idle_between_datas(assert_clean):
    """A worker killed while the master only manipulates Data: the next command reports it."""
    from test_failures import A, CRASH_DEADLINE
    try:
        synk.fork(2)
        a = T.vector("a", dtype="float32")
        b = T.vector("b", dtype="float32")
        f7 = synk.function([a, b], (T.sum(a * b), "sum"))
        synk.distribute()
        d = synk.data(A)
        assert f7(d, d) == pytest.approx(float(np.sum(A * A)))
        prefix = tu.prefix()
        tu.kill_rank(1, wait=False)
        d.set_value(np.arange(50, dtype=np.float32))   # master-only work still fine
        t0 = time.monotonic()
        with pytest.raises(synk.WorkerDied):
            f7(d, d)
        assert time.monotonic() - t0 < CRASH_DEADLINE
        assert synk.session_info() is None
        assert tu.shm_entries(prefix) == []
        with pytest.raises(RuntimeError):
            d.set_value(A)
    finally:
        synk.close()
    assert_clean()


def test_worker_killed_during_a_call(assert_clean):
    """The worker is stopped so the call is surely in flight, then killed: WorkerDied."""
    from test_failures import CRASH_DEADLINE, X, Y, _g1_graph, _g1_ref
    pid = None
    try:
        synk.fork(2)
        x, y, z = _g1_graph()
        f = synk.function([x], z, bcast_inputs=[y])
        synk.distribute()
        assert np.isclose(f(X, Y), _g1_ref(X, Y), rtol=1e-5)
        prefix = tu.prefix()
        pid = tu.pid_of(1)
        os.kill(pid, signal.SIGSTOP)
        # killed before it has been stopped for launcher.STOP_GRACE (then WorkerStopped)
        killer = threading.Timer(0.5, lambda: os.kill(pid, signal.SIGKILL))
        killer.start()
        t0 = time.monotonic()
        try:
            with pytest.raises(synk.WorkerDied) as ei:
                f(X, Y)                              # waits for the stopped worker ...
        finally:
            killer.cancel()
            killer.join()
        dt = time.monotonic() - t0
        assert 0.4 <= dt < CRASH_DEADLINE, dt      # ... until it was killed
        assert ei.value.rank == 1 and ei.value.returncode == -signal.SIGKILL
        assert "call" in str(ei.value)
        assert synk.session_info() is None
        assert tu.shm_entries(prefix) == []
    finally:
        if pid is not None and tu.pid_running(pid):
            os.kill(pid, signal.SIGKILL)
        synk.close()
    assert_clean()


# ==============================================================================================
# Frozen and slow ranks: stopped (SIGSTOP), or stuck in user code

FROZEN = {
    "call": lambda s: s.fg(np.arange(9.0)),
    "call num_slices=3": lambda s: s.fg(np.arange(9.0), num_slices=3),
    "all_reduce": lambda s: synk.all_reduce(s.w),
    "broadcast (>= 1 MB)": lambda s: synk.broadcast(s.v, np.ones(200_000)),
    "gather": lambda s: synk.gather(s.w),
    "scatter": lambda s: synk.scatter(s.w, np.arange(24.0)),
    "get_value": lambda s: synk.get_value(VICTIM, s.w),
}


@pytest.mark.parametrize("name", list(FROZEN))
def test_stopped_rank_is_reported(name):
    """A worker stopped with SIGSTOP (state T) is named within 5 s, whatever the master waits
    in; the session closes itself and leaves nothing behind (the stopped process included)."""
    run = FROZEN[name]
    try:
        s = build()
        run(s)                                       # works, and is warm
        os.kill(s.pids[VICTIM], signal.SIGSTOP)
        e, dt = raises_within(lambda: run(s))
        record(name, "SIGSTOP", e, dt)
        assert isinstance(e, synk.WorkerStopped) and e.rank == VICTIM and e.ranks == (VICTIM,), repr(e)
        assert f"rank {VICTIM}" in str(e) and "stopped" in str(e)
        assert dt < 5.0
        assert synk.session_info() is None
        assert_gone(s.prefix, s.pids.values())
    finally:
        synk.close()


def test_flight_recorder_says_who_is_stuck_where(capfd):
    """A stopped worker during all_reduces: the stall warning comes with the flight report
    (every rank: its command and collective and since when; the master and the others
    waiting in a vote, on whom; the stopped rank marked), SIGUSR1 prints it on demand, and
    the loss prints it once more before ``WorkerStopped``."""
    try:
        s = build(stall=0.4)
        synk.all_reduce(s.w, "sum")                               # warm
        info = synk.session_info()
        assert [f.rank for f in info.flight] == list(range(N)) and all(f.command < 0 for f in info.flight)
        assert [f.pid for f in info.flight] == [r.pid for r in info.ranks]
        assert all(h[1] == "all_reduce" and h[2] == 64 for f in info.flight for h in f.history[-1:])
        capfd.readouterr()
        os.kill(s.pids[VICTIM], signal.SIGSTOP)
        threading.Timer(0.6, lambda: os.kill(os.getpid(), signal.SIGUSR1)).start()
        e, dt = raises_within(lambda: [synk.all_reduce(s.w, "sum") for _ in range(1000)])
        assert isinstance(e, synk.WorkerStopped) and e.rank == VICTIM
        err = capfd.readouterr().err
        for title in ("flight recorder at the stall", "flight recorder (SIGUSR1)",
                      f"flight recorder when rank {VICTIM} was lost"):
            assert f"synkhronos {title}" in err, err
        report = err.split("synkhronos flight recorder (SIGUSR1):")[1].split("synkhronos")[0]
        lines = {int(ln.split()[1]): ln for ln in report.splitlines() if ln.strip().startswith("rank ")
                 and "last collectives" not in ln}
        assert "STOPPED" in lines[VICTIM] and "STOPPED" not in lines[0]
        assert "(all_reduce)" in lines[0] and "waiting for a vote" in lines[0] and f"on rank(s) {VICTIM}" in lines[0]
    finally:
        synk.close()


def test_slow_rank_warns_and_is_never_killed(capfd):
    """A rank stuck in user code (here: 2 s of sleep) only makes the master warn, naming it,
    after each stall interval; without a timeout the call completes correctly."""
    try:
        s = build("sleep", stall=0.5)
        assert s.f(np.arange(9.0)) == 36.0      # compiled (and loaded by every rank) first: the
        capfd.readouterr()                      # warnings below are about the slow rank alone
        t0 = time.monotonic()
        assert s.f(fs.with_trigger(np.ones(9), VICTIM, N)) == 8.0 + fs.TRIGGER
        assert time.monotonic() - t0 >= fs.SLEEP_S
        err = capfd.readouterr().err
        warnings = [ln for ln in err.splitlines() if "synkhronos: stall" in ln and "call of function" in ln]
        assert len(warnings) >= 2, err                       # every 0.5 s of the 2 s
        assert all(f"rank(s) {VICTIM} " in w for w in warnings), warnings
        assert s.f(np.arange(9.0)) == 36.0                   # and the session is fine
        TIMES.append(("call (rank 2 busy 2 s)", "slow rank", "stall warnings only", "2", None))
    finally:
        synk.close()


@pytest.mark.parametrize("how", ["fork", "env"])
def test_timeout_turns_a_stall_into_an_error(how, monkeypatch):
    """With a timeout, a rank that does not answer in time is named in StallTimeout and the
    session closes cleanly."""
    kw = {}
    if how == "fork":
        kw = dict(timeout=0.8)
    else:
        monkeypatch.setenv("SYNK_TIMEOUT", "0.8")
    try:
        s = build("sleep", **kw)
        assert s.f(np.arange(9.0)) == 36.0            # the first call (it compiles: no timeout)
        e, dt = raises_within(lambda: s.f(fs.with_trigger(np.ones(9), VICTIM, N)))
        record(f"call (timeout via {how})", "rank 2 busy 2 s", e, dt)
        assert isinstance(e, synk.StallTimeout) and e.ranks == (VICTIM,), repr(e)
        assert 0.8 <= dt < 3.0
        assert f"rank(s) {VICTIM}" in str(e) and "timeout" in str(e)
        assert synk.session_info() is None
        assert_gone(s.prefix, s.pids.values())
    finally:
        synk.close()


def test_timeout_spares_the_first_call():
    """The first call of a function compiles (up to minutes for big graphs): the timeout does
    not apply to it (nor to distribute), stall warnings do."""
    try:
        s = build("sleep", timeout=0.8, stall=0.5)
        assert s.f(fs.with_trigger(np.ones(9), VICTIM, N)) == 8.0 + fs.TRIGGER     # 2 s, first call
        assert tu.is_open()
        e, dt = raises_within(lambda: s.f(fs.with_trigger(np.ones(9), VICTIM, N)))  # not the first
        assert isinstance(e, synk.StallTimeout), repr(e)
    finally:
        synk.close()


def test_stall_and_timeout_arguments_are_checked():
    for bad in (-1, "5", True):
        with pytest.raises(ValueError, match="seconds"):
            synk.fork(2, timeout=bad)
        with pytest.raises(ValueError, match="seconds"):
            synk.fork(2, stall=bad)
        with pytest.raises(ValueError, match="seconds"):
            synk.fork(2, spin=bad)
    with pytest.raises(ValueError, match="seconds"):
        synk.fork(2, spin=1.5)
    assert synk.session_info() is None


@pytest.mark.parametrize("spin", [0, 0.002])
def test_spin_only_changes_how_ranks_wait(spin):
    """spin=0: every wake-up goes through the semaphores (nobody polls); a long spin: the
    ranks poll through the pauses.  Either way every call is right."""
    x = T.vector("x")
    tu.fork(2, spin=spin)
    try:
        f = synk.function([x], ((x * 2).sum(), "sum"))
        synk.distribute()
        rng = np.random.default_rng(5)
        for i in range(30):
            v = rng.standard_normal(5 + i % 4)
            assert np.isclose(f(v), 2 * v.sum())
            if i % 10 == 0:
                time.sleep(0.05)          # a pause: the workers fall asleep
    finally:
        synk.close()


# ==============================================================================================
# The master killed, and Ctrl-C in the master (master programs in subprocesses)

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


@pytest.mark.parametrize("what", ["call", "collectives"])
def test_master_killed_while_busy(what):
    """SIGKILL of the master in the middle of a long call (every worker busy for SLEEP_S) or
    of a stream of collectives: every worker exits and every segment goes within seconds."""
    info, _, out, rc, t_kill = run_script("master_busy", what, kill_after=0.5)
    assert info is not None, out
    try:
        assert rc == -signal.SIGKILL
        limit = (fs.SLEEP_S if what == "call" else 0) + 5.0
        gone = tu.wait_until(lambda: not any(tu.pid_running(p) for p in info["pids"]), limit)
        t_gone = time.monotonic() - t_kill
        assert gone, f"workers still running {limit} s after the master was killed"
        clean = tu.wait_until(lambda: not tu.shm_entries(info["prefix"]), 5.0)
        t_clean = time.monotonic() - t_kill
        assert clean, tu.shm_entries(info["prefix"])
        TIMES.append((f"master busy in {what}", "SIGKILL master", "workers exit + segments gone",
                      "-", max(t_gone, t_clean)))
    finally:
        tu.remove_all(info["prefix"])


_HANG = "BUG: runtime.py Runtime._collect: "  # shared prefix of the two hang reasons


def test_worker_exit_keeps_exit_handlers_and_output(tmp_path, request):
    """A worker that quit ends without the interpreter's slow teardown, yet what its user
    code left to do at exit still happens: exit handlers run, buffered output arrives."""
    n = 3
    info, res, out, rc, _ = run_script("worker_exit", str(n), env={"SYNK_TEST_EXIT_DIR": str(tmp_path)})
    assert rc == 0 and res is not None, out[-3000:]
    assert res["total"] == sum(range(2 * n))
    assert sorted(os.listdir(tmp_path)) == [f"rank{r}" for r in range(1, n)], out[-3000:]
    for r in range(1, n):
        assert f"unflushed words of rank {r}" in out, out[-3000:]
    assert tu.shm_entries(res["prefix"]) == []
    fs.report(request.config, f"close() of {n} ranks: {res['close_s'] * 1e3:.0f} ms")


@pytest.mark.parametrize("where,then", [
    pytest.param("master", "continue", id="master-share-continue"),
    pytest.param("master", "close", id="master-share-close", marks=pytest.mark.slow),
    pytest.param("worker", "continue", id="waiting-for-worker-continue", marks=pytest.mark.slow),
    pytest.param("worker", "close", id="waiting-for-worker-close"),
    pytest.param("barrier", "continue", id="in-all_reduce-continue"),
    pytest.param("barrier", "close", id="in-all_reduce-close", marks=pytest.mark.slow),
])
def test_ctrl_c_in_master(where, then):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) during a long call or a
    collective: KeyboardInterrupt reaches the user promptly and the runtime stays usable
    (documented: the next command first collects the interrupted one), or close()s cleanly;
    nothing is left behind."""
    info, res, out, rc, _ = run_script("ctrl_c", where, then)
    assert info is not None and res is not None, out[-3000:]
    try:
        assert res["interrupted"], "the call was not interrupted"
        assert res["ki_s"] < 0.5 + 1.5, res          # KeyboardInterrupt within ~1 s of Ctrl-C
        assert res["closed_after_ki"] is False         # documented: stays usable
        assert res.get("hung") is None, f"hung in step {res['hung']!r} (killed by the watchdog)"
        if then == "continue":
            assert res["next_result"] == 15.0 and res["again_result"] == 28.0
            assert res["next_s"] < fs.SLEEP_S + 2.0
            assert res["w_unchanged"], "the interrupted command changed a variable"
            assert res["all_reduce_ok"]
        assert res["close_s"] < fs.SLEEP_S + 2.0
        assert res["left"] == []
        assert rc == 0
        TIMES.append((f"Ctrl-C ({where}, {then})", "SIGINT group", "KeyboardInterrupt", "-",
                      res["ki_s"] - 0.5))
    finally:
        assert tu.wait_until(lambda: not any(tu.pid_running(p) for p in info["pids"]), 5.0)
        assert tu.wait_until(lambda: not tu.shm_entries(info["prefix"]), 5.0), \
            tu.shm_entries(info["prefix"])


# ==============================================================================================
# Ctrl-C at random instants, thousands of times

_STORM_ENV = {"numba": None, "JAX": {"SYNK_MODE": "JAX"},
              "JAX-device-adds": {"SYNK_MODE": "JAX", "SYNK_STAGED_REDUCE": "device"}}


@pytest.mark.parametrize("mode,n,target", [
    ("numba", 1, 150), ("numba", 3, 600), ("JAX-device-adds", 2, 300),
    *(pytest.param(*p, marks=pytest.mark.slow) for p in [("numba", 2, 1200), ("numba", 3, 1500), ("JAX", 1, 300),
                                                         ("JAX", 2, 600), ("JAX-device-adds", 2, 600),
                                                         ("numba", 3, 20000)])])
def test_sigint_storm(mode, n, target):
    """Calls (with updates, num_slices, every output mode), training steps (plain and fp16:
    gradient and parameters checked together) and collectives under SIGINTs at random
    instants of each operation.  Every completed result matches a model of every rank's
    state; after every interrupt the state is the one before the operation or the one after
    it, on every rank at once; the session ends clean.  On JAX ranks too: an
    interrupt during a jitted call's dispatch once surfaced as jaxlib's ``ValueError: Cache
    keys should be comparable`` instead of a KeyboardInterrupt.  And with the all-reduces of
    the host-staged path added on the device (SYNK_STAGED_REDUCE=device, the GPUs' path)."""
    info, res, out, rc, _ = run_script("sigint_storm", str(target), str(n), "300",
                                       timeout=360 if target > 5000 else 150, env=_STORM_ENV[mode])
    assert rc == 0 and res is not None, out[-3000:]
    if mode == "JAX-device-adds":
        assert "all_reduce adding on the device" in out, out[:2000]
    assert res["interrupts"] >= target, res
    assert res["mismatches"] == [], res["mismatches"]
    assert res["inconsistent"] == [], res["inconsistent"]
    assert res["completed"] > target                 # interrupts fall among completed work
    assert res["final_f"] == 45.0
    assert res["left"] == []
    assert_gone(info["prefix"], info["pids"])
    TIMES.append((f"{res['completed'] + res['interrupted']} ops, n={n}", f"{res['interrupts']} SIGINTs",
                  "KeyboardInterrupt / correct", "-", None))


def test_close_under_a_sigint_storm_leaves_nothing():
    """Ctrl-C at random instants of ``synk.close()`` (called again after each interrupt),
    6 sessions: every one ends with its workers gone and nothing of it in /dev/shm."""
    info, res, out, rc, _ = run_script("close_storm", "6", timeout=240)
    assert rc == 0 and res is not None, out[-3000:]
    assert res["closed"] == 6 and res["interrupts"] > 0, res
    assert res["left"] == {} and res["alive"] == {}, res


def test_sigterm_closes_quietly():
    """SIGTERM to a master waiting for a worker: exit status 128 + 15, no traceback, the
    session closed (workers gone, shared memory removed)."""
    info, res, out, rc, _ = run_script("terminate", timeout=60)
    assert rc == 128 + signal.SIGTERM, out[-2000:]
    assert "Traceback" not in out and "SystemError" not in out, out[-2000:]
    assert_gone(info["prefix"], info["pids"])


def test_ctrl_c_while_compiling_stays_a_keyboard_interrupt(tmp_path):
    """Ctrl-C while the first call compiles (cold cache): a plain KeyboardInterrupt once the
    compile is done (an interrupt inside LLVM could crash the process); the next call works."""
    info, res, out, rc, _ = run_script("interrupt_compile", timeout=240,
                                       env={"PYTENSOR_FLAGS": f"base_compiledir={tmp_path / 'cold'}"})
    assert rc == 0 and res is not None, out[-3000:]
    assert res["raised"] == "KeyboardInterrupt", res
    assert res["w_after"] == [[0.0] * 3] * 2, res        # its update was applied on no rank
    assert res["next"] == pytest.approx(30.95291446137326) and res["open"]
    assert "SystemError" not in out and "double free" not in out
    assert_gone(info["prefix"], info["pids"])


def test_ranks_waiting_in_graph_wake_when_a_late_rank_arrives():
    """In-graph small all-reduces meet through their rows' tokens: the late rank's arrival
    must wake the ranks already sleeping there (not their next 20 ms tick).  A rank 2 ms
    late before two chained ops: a call took 23 ms before the fix, 2.4 ms after."""
    from synkhronos import ops
    fs.quiet()
    synk.fork(2)
    try:
        v = T.dvector("v")
        y = ops.all_reduce(ops.all_reduce(fs.Lag(1, 0.002)(v), "sum"), "sum")
        f = synk.function([], (T.sum(y), None), bcast_inputs=[v], mode="FAST_COMPILE")
        synk.distribute()
        x = np.arange(8.0)
        times = []
        for _ in range(12):
            t = time.perf_counter()
            assert f(x) == 4 * x.sum()
            times.append(time.perf_counter() - t)
        # without the wake-up every call waits for the sleepers' 20 ms tick; the fastest call
        # shows it (a median also counts the calls a loaded machine delays: 12.8 ms once in CI)
        assert min(times[2:]) < 0.012, f"calls took {np.round(np.array(times) * 1e3, 1)} ms"
    finally:
        synk.close()
