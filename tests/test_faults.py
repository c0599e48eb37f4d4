"""Fault matrix: a worker raising or killed (SIGKILL) at every phase of a running session.
Every fault must end in an exception in the master within ``BOUND`` seconds that names the
rank, after which ``close()`` works and no process and no /dev/shm entry of the session
remains.  Faults at start-up (fork, distribute) are in ``test_faults_startup.py``, stopped
and slow ranks in ``test_faults_stalls.py``, the master's own (killed, Ctrl-C, SIGTERM) in
``test_faults_master.py``; their shared helpers in ``fault_testutil.py``.

How faults are caused (no monkeypatching of synkhronos):

* function calls: a test Op (``_fault_ops.Fault``) raising / SIGKILLing in one rank, only
  when that rank's shard holds a trigger value (with and without ``num_slices``);
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
import os
import signal
import threading
import time

import numpy as np
import pytest
import pytensor.tensor as T

import synkhronos as synk
import synk_testutil as tu
import _fault_ops as fo
from fault_testutil import (N, TIMES, VICTIM, assert_died, assert_gone, build, choked, raises_within,
                            record)
from fault_testutil import times_table  # noqa: F401  (autouse: the module's table of times)

fo.quiet()
pytestmark = pytest.mark.filterwarnings("ignore:Numba will use object mode")


# ---- helpers --------------------------------------------------------------------------------

def starved(s, fn, rank=VICTIM):
    """``fn`` run while worker ``rank`` is out of file descriptors."""
    def run():
        with choked(rank):
            fn()
    return run


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
        e = self.check(S, "call", lambda: S.f(fo.with_trigger(np.ones(9), VICTIM, N)),
                       match="FaultInjected")
        assert "synk-fault injected in rank 2 at perform" in str(e)

    def test_call_sliced(self, S):
        self.check(S, "call num_slices=3", lambda: S.f(fo.with_trigger(np.ones(30), VICTIM, N),
                                                         num_slices=3), match="FaultInjected")

    def test_call_in_master_and_worker(self, S):
        v = fo.with_trigger(np.ones(9), VICTIM, N)
        v[0] = fo.TRIGGER        # the master's own Fault op never fires: only rank 2 fails
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
# SIGKILL of a worker while the session runs (each cell closes its runtime)

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
        e, dt = raises_within(lambda: s.f(fo.with_trigger(np.ones(30), VICTIM, N),
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
