"""What the tests that run under real ``mpiexec`` share: finding it, running a program on
this machine or on two simulated hosts (``simhosts``), reading its ``SYNK-INFO`` /
``SYNK-RESULT`` lines, and checking that the hosts are left clean."""
import json
import os
import subprocess
import sys
import time

import pytest

import synk_testutil as tu

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)
MPIEXEC = os.path.join(BIN, "mpiexec")


def mpi_missing():
    """Why MPI tests cannot run here, or None."""
    if not os.path.exists(MPIEXEC):
        return "no mpiexec next to the interpreter (pip install 'synkhronos[mpi]')"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "mpi4py is not installed (pip install 'synkhronos[mpi]')"
    return None


def mpi_env(env=None):
    """``env`` (default: this one) without the variables of an enclosing MPI launcher, with
    ``mpiexec`` on the PATH."""
    env = {k: v for k, v in (os.environ if env is None else env).items() if not k.startswith(("PMI_", "MPI_LOCAL"))}
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    return env


def parse(out):
    """(the first ``SYNK-INFO``, the last ``SYNK-RESULT``) of a program's output, as objects."""
    info = res = None
    for line in out.splitlines():
        line = line.split("] ", 1)[-1] if line.startswith("[") else line
        if line.startswith("SYNK-INFO ") and info is None:
            info = json.loads(line[len("SYNK-INFO "):])
        elif line.startswith("SYNK-RESULT "):
            res = json.loads(line[len("SYNK-RESULT "):])
    return info, res


def run_local(script, nprocs, *args, timeout=120):
    """``mpiexec -n NPROCS python SCRIPT ARGS`` on this machine: (process, info, result)."""
    p = subprocess.run([MPIEXEC, "-n", str(nprocs), sys.executable, os.path.join(HERE, script), *args],
                       capture_output=True, text=True, timeout=timeout, env=mpi_env(), cwd=HERE)
    info, res = parse(p.stdout)
    return p, info, res


def mpich_files():
    """MPICH's own shared-memory files in this host's /dev/shm."""
    try:
        return sorted(e for e in os.listdir("/dev/shm") if e.startswith("mpich_shm_"))
    except OSError:
        return []


def simhosts_or_skip():
    import simhosts
    ok, why = simhosts.available()
    if not ok:
        pytest.skip(f"simulated hosts unavailable: {why}")
    return simhosts


def run_hosts(hosts, script, *args, timeout=120, env=None, per_host=1):
    """``SCRIPT ARGS`` under ``mpiexec`` with ``per_host`` MPI processes on each simulated
    host: (process, info, result) (results through a file: two hosts' output can interleave)."""
    out = os.path.join("/tmp", f"synk-mpi-{os.getpid()}-{time.monotonic_ns()}.jsonl")
    try:
        cmd = hosts.mpiexec_cmd(2 * per_host, per_host, [sys.executable, os.path.join(HERE, script), *args],
                                extra=("-prepend-rank",), env=dict(env or {}, SYNK_RESULT_FILE=out))
        p = hosts.run(cmd, timeout=timeout)
        hosts.wait_idle(5)
        info, res = parse(open(out).read() if os.path.exists(out) else "")
    finally:
        if os.path.exists(out):
            os.unlink(out)
    return p, info, res


def assert_hosts_clean(hosts):
    """Nothing left on any simulated host: no file in /dev/shm (MPICH's included), no process."""
    assert tu.wait_until(lambda: not any(hosts.shm_files().values()), 5.0), hosts.shm_files()
    assert tu.wait_until(lambda: not any(hosts.pids().values()), 5.0), hosts.processes()
