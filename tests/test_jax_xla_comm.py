"""XLA's multi-process collectives (the path NCCL serves on GPUs), forced on CPU ranks with
``SYNK_JAX_COMM=xla``, where they run over gloo.  ``jax.distributed`` must be set up before
any JAX use in the master, so each scenario runs as its own master process
(``_jax_xla_script.py``): values against numpy for every op and several dtypes (n = 2, 3),
exact broadcast, unequal all_gather, unequal shapes refused on every rank, fallbacks to the
host-staged path; in-graph collectives (``synkhronos.ops``) as one XLA program (and a
Ctrl-C storm over them); a worker killed inside a collective and inside such a program, one
frozen inside such a program, a worker dead past JAX's heartbeat timeout (the master is
not aborted by JAX), and a killed master (its workers exit)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

import synk_testutil as tu

pytest.importorskip("jax")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_jax_xla_script.py")


def run(scenario, n=2, timeout=120, env=None):
    e = dict(os.environ, **(env or {}))
    e.pop("SYNK_MODE", None)
    p = subprocess.run([sys.executable, SCRIPT, scenario, str(n)], capture_output=True, text=True,
                       timeout=timeout, env=e)
    results = [json.loads(line[len("RESULT "):]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    assert p.returncode == 0 and "DONE" in p.stdout, (
        f"{scenario} exited {p.returncode}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-5000:]}")
    return results[-1] if results else None


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_values_against_numpy(n):
    res = run("values", n)
    assert res["checked"] == 40
    picked = res["picked"]
    assert {k: v for k, v in picked.items() if v != "xla"} == {"reduce float64": "staged",
                                                             "all_reduce bool": "staged"}


def test_worker_killed_inside_a_collective():
    t = time.monotonic()
    res = run("kill_in_collective", 2, timeout=60)
    assert res["error"] == "WorkerDied" and "rank 1" in res["message"]
    assert res["seconds"] < 10 and time.monotonic() - t < 60


# test_ops' cases whose graph runs as one XLA program on even shards (the others run as
# stretches: a product's gradient, which PyTensor's JAX backend cannot trace without a
# known length, and reduce_scatter counts given as an input, known only when it runs)
ONE_PROGRAM = {"all_reduce_sum", "all_reduce_avg", "all_reduce_max", "all_reduce_min", "all_gather",
               "reduce_scatter_sum", "reduce_scatter_avg", "reduce_scatter_max", "broadcast_0", "broadcast_1",
               "reduce_sum_0", "reduce_max_0", "reduce_sum_1", "max_tie"}


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_in_graph_collectives_as_one_program(n, tmp_path):
    """Every in-graph collective's values and gradients equal the serial graph's, as one XLA
    program per call on even shards (each rank's timeline shows it, once per case: the
    uneven call ran as stretches), on one row a rank (n = 2) and as stretches on uneven
    shards; float16 all_reduce, all_gather and broadcast as one program, exact."""
    res = run("in_graph", n, timeout=300, env={"SYNK_TEST_TMP": str(tmp_path)})
    assert sorted(res["programs"]) == [str(r) for r in range(n)]
    for r, by_function in res["programs"].items():
        assert by_function == {name: 2 if n == 2 else 1 for name in ONE_PROGRAM} | {"float16": 1}, (r, by_function)


def test_worker_killed_inside_an_in_graph_program(tmp_path):
    t = time.monotonic()
    res = run("kill_in_program", 2, timeout=120, env={"SYNK_TEST_TMP": str(tmp_path)})
    assert res["error"] == "WorkerDied" and "rank 1" in res["message"]
    assert res["seconds"] < 10 and time.monotonic() - t < 120


def test_worker_frozen_inside_an_in_graph_program(tmp_path):
    t = time.monotonic()
    res = run("stop_in_program", 2, timeout=120, env={"SYNK_TEST_TMP": str(tmp_path)})
    assert res["error"] == "WorkerStopped" and "rank 1" in res["message"]
    assert res["seconds"] < 15 and time.monotonic() - t < 120
    assert not tu.pid_running(res["victim"])


def test_ctrl_c_storm_during_in_graph_programs():
    """A Ctrl-C after the ranks met and before this rank's dispatch would leave the others
    inside XLA's collective (on a CPU device, inside the dispatch, where nothing else is
    watched): every call ends, done or interrupted, and the session stays whole."""
    res = run("program_storm", 2, timeout=180, env={"STORM_S": "8"})
    out = res["outcomes"]
    assert out["done"] > 20 and out["interrupted"] > 20, out
    assert res["equal"]
    assert tu.shm_entries(res["prefix"]) == []


def test_worker_dead_past_jax_heartbeat_timeout():
    res = run("kill_idle", 2, timeout=60, env={"SYNK_JAX_HEARTBEAT": "2"})
    assert res["error"] == "WorkerDied"


def test_killed_master_takes_its_workers_along():
    """JAX's own client ends a worker whose coordinator (the master) is gone; the session's
    shared memory is then removed by the next session's reaper (as when every process of a
    session is killed at once)."""
    e = dict(os.environ)
    e.pop("SYNK_MODE", None)
    p = subprocess.Popen([sys.executable, SCRIPT, "master_killed", "2"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True, env=e)
    try:
        res = None
        for line in p.stdout:
            if line.startswith("RESULT "):
                res = json.loads(line[len("RESULT "):])
                break
        assert res is not None, "the script did not start its session"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        p.stdout.close()
    assert tu.wait_until(lambda: not any(tu.pid_running(w) for w in res["workers"]), 20.0), \
        "workers outlived their killed master"
    from synkhronos import backends
    backends.reap("local")
    assert tu.shm_entries(res["prefix"]) == []
