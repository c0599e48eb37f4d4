"""XLA's multi-process collectives (the path NCCL serves on GPUs), forced on CPU ranks with
``SYNK_JAX_COMM=xla``, where they run over gloo.  ``jax.distributed`` must be set up before
any JAX use in the master, so each scenario runs as its own master process
(``_jax_xla_script.py``): values against numpy for every op and several dtypes (n = 2, 3),
exact broadcast, unequal all_gather, unequal shapes refused on every rank, fallbacks to the
host-staged path; a worker killed inside a collective, a worker dead past JAX's heartbeat
timeout (the master is not aborted by JAX), and a killed master (its workers exit)."""
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


@pytest.mark.parametrize("n", [2, 3])
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
