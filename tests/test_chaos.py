"""The chaos soak on two simulated hosts (``_chaos_mpi.py``), with CPU-bound programs beside
the job: random faults (a worker of either host killed or frozen, an exception in a rank,
Ctrl-C in the master) at random moments of random calls and collectives (4 KB to 64 MB).
Every fault ends as promised (named rank and host within 5 s, session closed or going
on), no run hangs, and nothing is left on either host afterwards (no /dev/shm file,
MPICH's included; no process).

Short form in the suite (``RUNS_SHORT`` faults); the full soak (200 faults, or
``SYNK_CHAOS_RUNS``) from one command::

    SYNK_CHAOS_RUNS=200 .venv/bin/python -m pytest -m slow tests/test_chaos.py -s

It prints the table of runs x faults x outcomes.  Also: the agent of the other host
killed (MPICH then ends the whole job): every process on both hosts ends and nothing is
left behind."""
import os
import signal
import subprocess
import sys
import time

import pytest

import synk_testutil as tu
from mpi_testutil import assert_hosts_clean, mpi_missing, parse, run_hosts, simhosts_or_skip

pytestmark = pytest.mark.skipif(mpi_missing() is not None, reason=str(mpi_missing()))

RUNS_SHORT = 5


@pytest.fixture(scope="module")
def hosts():
    with simhosts_or_skip().SimHosts(("hA", "hB")) as h:
        yield h


@pytest.fixture
def load():
    """Two CPU-bound programs beside the job for the test's duration."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _table(res):
    lines = [f"chaos soak: {res['runs']} runs, {res['faults']} faults, {res['hangs']} hangs, "
             f"{len(res['wrong'])} wrong, slowest report {res['slowest']:.2f} s; sessions "
             + ", ".join(f"{k}: {v}" for k, v in sorted(res["sessions"].items()))]
    for key, count in sorted(res["outcomes"].items()):
        lines.append(f"  {key:<40} {count:>5}")
    return "\n".join(lines)


def _soak(hosts, runs, seed, request):
    p, info, res = run_hosts(hosts, "_chaos_mpi.py", str(runs), str(seed), timeout=120 + 60 * runs)
    out = p.stdout + p.stderr
    if os.environ.get("SYNK_CHAOS_LOG"):          # the whole output, for a post-mortem
        with open(os.environ["SYNK_CHAOS_LOG"], "w") as fh:
            fh.write(out)
    if "SYNK-HANG" in out:                 # the hung run, what every rank was doing, the stacks
        runs_seen = [ln for ln in out.splitlines() if "SYNK-RUN" in ln or "chaos run" in ln]
        pytest.fail("a run hung:\n" + "\n".join(runs_seen[-3:]) + "\n" + out[out.find("synkhronos: stall"):][:12000])
    assert p.returncode == 0 and res is not None, out[-6000:]
    tu.report(request.config, _table(res))
    assert res["faults"] == runs and not res["wrong"], res["wrong"]
    assert res["slowest"] <= 5.0
    assert_hosts_clean(hosts)
    return res


@pytest.mark.timeout(900)
def test_chaos_short(hosts, load, request):
    _soak(hosts, RUNS_SHORT, 1, request)


@pytest.mark.slow
@pytest.mark.timeout(7200)
def test_chaos_full(hosts, load, request):
    _soak(hosts, int(os.environ.get("SYNK_CHAOS_RUNS", "200")), 2, request)


def test_agent_killed_ends_the_job_cleanly(hosts):
    """SIGKILL of the other host's MPI process (its agent): MPICH ends the job; the master's
    host's workers see their master gone, the other host's see their agent gone; every
    process ends and both hosts' /dev/shm are empty (MPICH's files included)."""
    out = f"/tmp/synk-mpi-{os.getpid()}-{time.monotonic_ns()}.jsonl"
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_mpi_scripts.py")
    cmd = hosts.mpiexec_cmd(2, 1, [sys.executable, script, "fault", "4", "idle"], extra=("-prepend-rank",),
                            env={"SYNK_RESULT_FILE": out})
    p = hosts.popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert tu.wait_until(lambda: os.path.exists(out) and '"ready"' in open(out).read(), 120)
        info, _ = parse(open(out).read())
        agent = [pid for pid, cmd in hosts.processes("hB") if "_mpi_scripts.py" in cmd]
        assert len(agent) == 1, hosts.processes()
        os.kill(agent[0], signal.SIGKILL)
        p.wait(timeout=30)
        assert_hosts_clean(hosts)
    finally:
        if p.poll() is None:
            p.kill()
        if os.path.exists(out):
            os.unlink(out)
