"""Frozen and slow ranks: a worker stopped (SIGSTOP) is named (``WorkerStopped``) within 5 s,
whatever the master waits in, and the flight recorder says who is stuck where; a rank stuck
in user code only makes the master warn, unless a timeout (``fork(timeout=)``,
``SYNK_TIMEOUT``) turns the stall into ``StallTimeout``; ``spin`` only changes how ranks
wait; ranks waiting in an in-graph all-reduce wake as soon as a late rank arrives.

The times are printed as a table on the terminal at the end of the module."""
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
from fault_testutil import N, TIMES, VICTIM, assert_gone, build, raises_within, record
from fault_testutil import times_table  # noqa: F401  (autouse: the module's table of times)

fo.quiet()
pytestmark = pytest.mark.filterwarnings("ignore:Numba will use object mode")


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
        assert s.f(fo.with_trigger(np.ones(9), VICTIM, N)) == 8.0 + fo.TRIGGER
        assert time.monotonic() - t0 >= fo.SLEEP_S
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
        e, dt = raises_within(lambda: s.f(fo.with_trigger(np.ones(9), VICTIM, N)))
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
        assert s.f(fo.with_trigger(np.ones(9), VICTIM, N)) == 8.0 + fo.TRIGGER     # 2 s, first call
        assert tu.is_open()
        e, dt = raises_within(lambda: s.f(fo.with_trigger(np.ones(9), VICTIM, N)))  # not the first
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


def test_ranks_waiting_in_graph_wake_when_a_late_rank_arrives():
    """In-graph small all-reduces meet through their rows' tokens: the late rank's arrival
    must wake the ranks already sleeping there (not their next 20 ms tick).  A rank 2 ms
    late before two chained ops: a call took 23 ms before the fix, 2.4 ms after."""
    from synkhronos import ops
    fo.quiet()
    synk.fork(2)
    try:
        v = T.dvector("v")
        y = ops.all_reduce(ops.all_reduce(fo.Lag(1, 0.002)(v), "sum"), "sum")
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


# ==============================================================================================
# A wait's liveness check against an answer that comes meanwhile

@pytest.mark.parametrize("raised", [KeyboardInterrupt, RuntimeError])
def test_an_interrupt_during_a_liveness_check_is_never_swallowed(raised):
    """A wait looks at the other side's liveness between looks at its answer; when the
    check raises and the answer is there by then, a loss reported just after the last reply
    is no loss (the wait returns), but an interrupt (Ctrl-C landing inside the check) must
    still raise: found under a SIGINT between hosts, where the answer of an MPI operation
    tested for up to 0.3 ms in that last look arrived often enough to swallow one Ctrl-C."""
    from synkhronos.waiting import Waiter
    checked = []

    def check():
        checked.append(True)
        raise raised("during the check")
    waiter = Waiter(check, stall=None, timeout=None, spin=0.0)
    ready = lambda: bool(checked)        # noqa: E731  (the answer comes during the check)
    if raised is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            waiter.wait(ready, lambda t: None)
    else:
        waiter.wait(ready, lambda t: None)
    assert checked == [True]
