"""The master's own faults, in master programs run as subprocesses (``_fault_scripts.py``,
``fault_testutil.run_script``): the master SIGKILLed while busy (its workers exit, its
segments go); Ctrl-C (SIGINT to the process group) during a call or a collective; SIGINTs
at random instants of thousands of operations, of ``close()``, of a compile; SIGTERM.  And
a worker's exit, which keeps its exit handlers and buffered output.

The times are printed as a table on the terminal at the end of the module."""
import os
import signal
import time

import pytest

import synk_testutil as tu
import _fault_ops as fo
from fault_testutil import TIMES, assert_gone, run_script
from fault_testutil import times_table  # noqa: F401  (autouse: the module's table of times)

fo.quiet()
pytestmark = pytest.mark.filterwarnings("ignore:Numba will use object mode")


# ==============================================================================================
# The master killed, and Ctrl-C in the master

@pytest.mark.parametrize("what,n", [("call", 3), ("collectives", 3), ("call", 1)])
def test_master_killed_while_busy(what, n):
    """SIGKILL of the master in the middle of a long call (every worker busy for SLEEP_S) or
    of a stream of collectives: every worker exits and every segment goes within seconds
    (a session of one rank: its guardian process frees them, no worker being there)."""
    info, _, out, rc, t_kill = run_script("master_busy", what, str(n), kill_after=0.5)
    assert info is not None, out
    try:
        assert rc == -signal.SIGKILL
        limit = (fo.SLEEP_S if what == "call" else 0) + 5.0
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
    tu.report(request.config, f"close() of {n} ranks: {res['close_s'] * 1e3:.0f} ms")


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
            assert res["next_s"] < fo.SLEEP_S + 2.0
            assert res["w_unchanged"], "the interrupted command changed a variable"
            assert res["all_reduce_ok"]
        assert res["close_s"] < fo.SLEEP_S + 2.0
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
