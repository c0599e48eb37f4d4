"""The simulated-hosts harness (tests/simhosts.py): two namespaced "hosts" on one machine,
MPICH hydra launching ranks on both through the fake ssh, and a teardown that leaves
nothing behind."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import simhosts  # noqa: E402

_OK, _WHY = simhosts.available()
pytestmark = pytest.mark.skipif(not _OK, reason=f"simulated hosts unavailable: {_WHY}")

try:
    import mpi4py  # noqa: F401
    _HAVE_MPI = True
except ImportError:  # pragma: no cover
    _HAVE_MPI = False

_MPI_SCRIPT = textwrap.dedent("""
    import json, os, socket, sys
    import numpy as np
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    shm_name = sys.argv[1]
    path = "/dev/shm/" + shm_name
    if rank == 0:  # a POSIX shm object on hA (rank 0 runs on the launch host)
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        os.write(fd, b"x")
        os.close(fd)
    comm.Barrier()
    sees = os.path.exists(path)
    n = 1 << 18  # 1 MiB of float32: the cross-host part must travel over the veth
    a = np.full(n, rank + 1, dtype=np.float32)
    out = np.empty_like(a)
    comm.Allreduce(a, out, op=MPI.SUM)
    ok = bool(np.all(out == size * (size + 1) / 2))
    rows = comm.gather(dict(rank=rank, host=socket.gethostname(), local_size=local.Get_size(),
                            local_rank=local.Get_rank(), sees_shm=sees, allreduce_ok=ok,
                            pid=os.getpid()), 0)
    local.Free()
    if rank == 0:
        print("RESULT " + json.dumps(rows), flush=True)
""")


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _netns_names():
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in r.stdout.splitlines() if line.strip()}


def _assert_gone(hosts, pids):
    assert hosts.leftovers() == []
    assert not (set(hosts.netns.values()) & _netns_names())
    left = [p for p in pids if _alive(p)]
    assert left == [], f"processes still running: {left}"
    assert not os.path.exists(hosts.tmpdir)


def test_helpers_and_isolation():
    with simhosts.SimHosts(("hA", "hB")) as hosts:
        for p in (hosts.inhost, hosts.nsssh, hosts.tmpdir):
            assert os.stat(p).st_mode & 0o077 == 0
        r = hosts.run("hostname; cat /etc/hosts", "hB", timeout=20)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines()[0] == "hB"
        assert f"{hosts.addr['hA']}\thA" in r.stdout
        # the fake ssh, as hydra calls it: ssh semantics (one shell command line)
        r = hosts.run([hosts.nsssh, "-x", "hB", "echo", "$(hostname)", "ok"], "hA", timeout=20)
        assert r.stdout.strip() == "hB ok", r.stderr
        # a file in hB's /dev/shm is seen by another command on hB, not on hA
        hosts.run("echo 1 > /dev/shm/synksim_probe", "hB", timeout=20)
        assert hosts.shm_files() == {"hA": [], "hB": ["synksim_probe"]}
        r = hosts.run("ls /dev/shm", "hB", timeout=20)
        assert r.stdout.split() == ["synksim_probe"]
        # the hosts reach each other over the veth
        code = "import socket; socket.create_connection(('hA', 9), timeout=5)"
        r = hosts.run([sys.executable, "-c", code], "hB", timeout=20)
        assert "ConnectionRefusedError" in r.stderr  # routed to hA, which has no listener
    _assert_gone(hosts, [])


@pytest.mark.skipif(not _HAVE_MPI, reason="mpi4py not installed")
def test_mpi_four_ranks_on_two_hosts(tmp_path):
    script = tmp_path / "check.py"
    script.write_text(_MPI_SCRIPT)
    shm_name = f"synksim_test_{os.getpid()}"
    with simhosts.SimHosts(("hA", "hB")) as hosts:
        rx0 = hosts.net_bytes("hB")[0]
        cmd = hosts.mpiexec_cmd(4, 2, [sys.executable, str(script), shm_name])
        r = hosts.run(cmd, timeout=120)
        assert r.returncode == 0, f"mpiexec failed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        assert line, r.stdout + r.stderr
        rows = sorted(json.loads(line[0][7:]), key=lambda d: d["rank"])
        assert [d["host"] for d in rows] == ["hA", "hA", "hB", "hB"]
        assert all(d["local_size"] == 2 for d in rows)
        assert [d["local_rank"] for d in rows] == [0, 1, 0, 1]
        assert all(d["allreduce_ok"] for d in rows)
        assert [d["sees_shm"] for d in rows] == [True, True, False, False]
        # the cross-host half of the Allreduce went over the veth (>= 1 MiB received)
        assert hosts.net_bytes("hB")[0] - rx0 > 1 << 20
        # the shm object is on hA only; MPICH left nothing after a clean exit
        assert hosts.shm_files() == {"hA": [shm_name], "hB": []}
        assert hosts.wait_idle(5.0), hosts.processes()
        assert hosts.clear_shm() == {"hA": [shm_name], "hB": []}
        assert hosts.shm_files() == {"hA": [], "hB": []}
    _assert_gone(hosts, [d["pid"] for d in rows])


def test_teardown_after_crash_kills_everything():
    with pytest.raises(RuntimeError, match="boom"):
        with simhosts.SimHosts(("hA", "hB")) as hosts:
            p1 = hosts.popen(["sleep", "1000"], "hA")
            # a detached process on hB that the harness did not start itself
            r = hosts.run("setsid sleep 1000 >/dev/null 2>&1 < /dev/null & echo $!", "hB",
                          timeout=20)
            p2 = int(r.stdout.strip())
            hosts.run("echo 1 > /dev/shm/mpich_shm_fake", "hB", timeout=20)
            assert hosts.shm_files("hB") == ["mpich_shm_fake"]
            time.sleep(0.1)
            pids = hosts.pids()
            assert p1.pid in pids["hA"] and p2 in pids["hB"]
            holders = list(hosts.holders.values())
            raise RuntimeError("boom")
    _assert_gone(hosts, [p1.pid, p2, *holders])


def test_three_hosts_on_a_bridge():
    with simhosts.SimHosts(("h1", "h2", "h3")) as hosts:
        assert hosts.bridge_ns
        code = ("import socket, sys\n"
                "for h in ('h1', 'h2', 'h3'):\n"
                "    try: socket.create_connection((h, 9), timeout=5)\n"
                "    except ConnectionRefusedError: print(h, 'reached')\n")
        r = hosts.run([sys.executable, "-c", code], "h3", timeout=20)
        assert r.stdout.split("\n")[:3] == ["h1 reached", "h2 reached", "h3 reached"], r.stderr
        ns = set(hosts.netns.values()) | {hosts.bridge_ns}
        assert ns <= _netns_names()
    assert not (ns & _netns_names())
    _assert_gone(hosts, [])


def test_stale_namespaces_of_dead_runners_are_removed():
    # a pid that does not exist: spawn and reap a short process
    p = subprocess.Popen(["true"])
    p.wait()
    name = f"{simhosts.NS_PREFIX}-{p.pid}-dead00-hA"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in simhosts.cleanup_stale()
        assert name not in _netns_names()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@pytest.mark.skipif(not _HAVE_MPI, reason="mpi4py not installed")
def test_rank_pids_and_kill_a_rank(tmp_path):
    """rank_pids() finds each rank; SIGKILL of one rank makes hydra end the whole job."""
    code = ("import sys, time; from mpi4py import MPI; c = MPI.COMM_WORLD; c.Barrier(); "
            "open(sys.argv[1] + '/ready%d' % c.rank, 'w').close(); time.sleep(60)")
    with simhosts.SimHosts(("hA", "hB")) as hosts:
        p = hosts.popen(hosts.mpiexec_cmd(4, 2, [sys.executable, "-c", code, str(tmp_path)]),
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("ready*"))) < 4 and time.monotonic() < deadline:
            assert p.poll() is None, p.stdout.read()
            time.sleep(0.05)
        ranks = hosts.rank_pids()
        assert [h for h, _ in ranks.values()] == ["hA", "hA", "hB", "hB"], ranks
        os.kill(ranks[3][1], signal.SIGKILL)
        out, _ = p.communicate(timeout=30)
        assert p.returncode != 0 and "BAD TERMINATION" in out
        assert hosts.wait_idle(5.0), hosts.processes()
        # MPICH leaves its segment on every host after a killed rank
        left = hosts.shm_files()
        assert all(any(f.startswith("mpich_shm_") for f in left[h]) for h in ("hA", "hB")), left
        hosts.clear_shm()


def test_run_timeout_kills_the_hosts_processes():
    with simhosts.SimHosts(("hA", "hB")) as hosts:
        t = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            hosts.run([hosts.nsssh, "hB", "sleep 1000"], "hA", timeout=1)
        assert time.monotonic() - t < 10
        assert hosts.pids() == {"hA": [], "hB": []}
        assert hosts.kill_all(sig=signal.SIGKILL) == []
