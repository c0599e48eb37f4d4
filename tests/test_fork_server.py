"""Workers forked by the fork server (backends/host/forked.py): they look and behave as
spawned ones (the master's children, their own command line, environment, directory and
process group), later sessions reuse the server, a changed environment gets a new one, a
dead or frozen server is replaced, Ctrl-C at any instant of ``fork()`` leaves no worker,
and the server ends with its master."""
import json
import os
import signal
import sys
import time

import numpy as np
import pytensor.tensor as T
import pytest
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

import _fault_ops as fo
import synk_testutil as tu
import synkhronos as synk
from fault_testutil import run_script


class EnvProbe(Op):
    """A rank's value of environment variable ``name`` (-1 when unset), as one float."""
    __props__ = ("name",)

    def __init__(self, name):
        self.name = name

    def make_node(self, x):
        return Apply(self, [T.as_tensor_variable(x)], [T.dvector()])

    def perform(self, node, inputs, output_storage):
        output_storage[0][0] = np.array([float(os.environ.get(self.name, "-1"))])


def _probe_all(name):
    x = T.dvector("x")
    f = synk.function([x], (EnvProbe(name)(x), "gather"))
    synk.distribute()
    return list(f(np.zeros(6)))


def _started(n=3):
    synk.fork(n)
    info = synk.session_info()
    return [(r.rank, r.pid) for r in info.ranks if r.rank != info.master_rank]


@pytest.fixture(autouse=True)
def _quiet_and_closed():
    fo.quiet()
    yield
    synk.close()


def test_forked_workers_look_spawned(monkeypatch):
    monkeypatch.setenv("SYNK_TEST_MARK", "7")
    workers = _started()
    servers = tu.fork_servers()
    assert len(servers) == 1, servers
    for rank, pid in workers:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            argv = fh.read().rstrip(b"\0").split(b"\0")
        assert [a.decode() for a in argv] == [sys.executable, "-P", "-m", "synkhronos.worker",
                                              json.dumps({"rank": rank})]
        assert tu.parent_of(pid) == os.getpid()               # the master's child, as spawned ones
        assert os.getpgid(pid) == pid                        # a process group of its own
        assert os.readlink(f"/proc/{pid}/cwd") == os.getcwd()
    assert _probe_all("SYNK_TEST_MARK") == [7.0] * 3       # the master's environment, in every rank


def test_later_sessions_reuse_the_server_and_a_new_environment_gets_its_own(monkeypatch):
    _started()
    synk.close()
    first = tu.fork_servers()
    _started()
    assert tu.fork_servers() == first and len(first) == 1
    synk.close()
    monkeypatch.setenv("SYNK_TEST_MARK", "3")                # (could change what an import does)
    _started()
    now = tu.fork_servers()
    assert len(now) == 1 and now != first
    assert _probe_all("SYNK_TEST_MARK") == [3.0] * 3


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_dead_or_frozen_server_is_replaced(how):
    _started()
    synk.close()
    [server] = tu.fork_servers()
    os.kill(server, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    t = time.monotonic()
    workers = _started()
    assert time.monotonic() - t < 15.0
    assert _probe_all("SYNK_TEST_MARK") == [-1.0] * 3
    assert not tu.pid_running(server)
    assert all(tu.parent_of(pid) == os.getpid() for _, pid in workers)


def test_off_switch_spawns(monkeypatch):
    monkeypatch.setenv("SYNK_FORK_SERVER", "0")
    before = tu.fork_servers()
    workers = _started()
    assert tu.fork_servers() == before and all(tu.parent_of(pid) == os.getpid() for _, pid in workers)
    assert _probe_all("SYNK_FORK_SERVER") == [0.0] * 3


def test_ctrl_c_storm_during_fork_leaves_no_worker():
    """1-3 SIGINTs at a random instant of ``fork(3)``, 10 times (the server's start
    included): every fork ends started or interrupted, no worker outlives its session,
    nothing is left in /dev/shm (an interrupted fork left its session's segments, forked or
    spawned), and the server ends with its master."""
    info, res, out, rc, _ = run_script("fork_storm", "10", timeout=180)
    assert rc == 0 and res is not None, out[-3000:]
    assert res["started"] + res["interrupted"] == 10 and res["interrupted"] > 0 and res["started"] > 0, res
    assert res["alive"] == [] and res["left"] == [], res
    assert len(res["servers"]) <= 1, res
    assert tu.wait_until(lambda: not any(tu.pid_running(p) for p in res["servers"]), 5.0), res


def test_worker_reaped_by_user_code_is_reported_gone():
    """The master adopts forked workers: user code that reaps children (``os.waitpid``, a
    loop of ``os.wait()``) may reap one that died.  Its exit status is then unknown: the
    session says the rank is gone, without inventing how it ended, and closes."""
    workers = _started(2)
    pid = workers[0][1]
    os.kill(pid, signal.SIGKILL)
    assert os.waitpid(pid, 0)[0] == pid                  # the user's code reaps it first
    with pytest.raises(synk.WorkerDied, match=r"rank 1\b.* is gone during") as ei:
        synk.distribute()
    assert ei.value.returncode is None
    assert not tu.is_open()
