"""Several machines: the same script under real ``mpiexec`` (MPICH from the ``mpich`` wheel).

* on localhost: 2 and 3 MPI processes, each leading its own group of ranks (3 to 5 ranks);
* on two simulated hosts (``simhosts``: each host its own network namespace, hostname, IPC
  and /dev/shm, joined by a veth pair; needs root), one MPI process per host.

Every function feature and collective is checked against numpy on the same data
(``_mpi_scripts.scenario_features``), a small MLP trained with the training kit against
the same training in one process, the asynchronous parameter server with workers on both
hosts (``scenario_ps``: training, staleness, a straggler, the bytes between the hosts,
Ctrl-C, a worker of the other host killed or frozen), and the failure cases: a rank killed or stopped on the
other host (named, with its host, within 5 s), an uncaught exception in the master (the
job ends instead of hanging), the master killed (every process on every host ends, and no
host's /dev/shm keeps anything, MPICH's own ``mpich_shm_*`` files included)."""
import os
import signal
import subprocess
import sys
import time

import pytest

import synk_testutil as tu

from mpi_testutil import assert_hosts_clean, mpi_missing, mpich_files, parse, simhosts_or_skip
from mpi_testutil import run_hosts as _run_hosts
from mpi_testutil import run_local as _run_local

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_mpi_scripts.py")
pytestmark = pytest.mark.skipif(mpi_missing() is not None, reason=str(mpi_missing()))


def run_local(nprocs, *args, timeout=120):
    return _run_local("_mpi_scripts.py", nprocs, *args, timeout=timeout)


# ---- localhost ------------------------------------------------------------------------------

@pytest.mark.parametrize("nprocs,n", [pytest.param(2, 3, marks=pytest.mark.slow), (2, 4), (3, 5)])
def test_local_every_feature(nprocs, n):
    p, info, res = run_local(nprocs, "features", str(n))
    assert p.returncode == 0 and res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    assert res["n"] == n and res["checks"] > 30
    assert res["failed"] == [], res["failed"]
    assert len(info["ranks"]) == n
    # nothing of the session, nor MPICH's file of this job (other jobs' may come and go)
    assert info["mpich"] and tu.shm_entries(info["prefix"]) == []
    assert not set(info["mpich"]) & set(mpich_files()), (info["mpich"], mpich_files())


def test_local_training_equals_serial():
    p, info, res = run_local(2, "train", "4", "20")
    assert p.returncode == 0 and res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    assert res["loss_last"] < res["loss_first"]
    assert res["loss_diff"] < 1e-12 and res["param_diff"] < 1e-12 and res["ranks_agree"] == 0.0


def test_hosts_sharded_updates_equal_serial(hosts):
    """ZeRO-1 across machines: Adam's state split over the 4 ranks of two hosts (blocks of
    the 176 parameters: 44 each), the step equal to serial training."""
    p, info, res = run_hosts(hosts, "train", "auto", "8", "adam", "1")
    assert p.returncode == 0 and res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    assert res["lengths"] == [[44, 44, 44, 44]] * 2, res["lengths"]
    assert res["loss_diff"] < 1e-12 and res["param_diff"] < 1e-12 and res["ranks_agree"] == 0.0
    assert_hosts_clean(hosts)


@pytest.mark.parametrize("what,exc", [("kill", "WorkerDied"),
                                      pytest.param("stop", "WorkerStopped", marks=pytest.mark.slow)])
def test_local_rank_lost_in_another_group(what, exc):
    p, info, res = run_local(2, "fault", "4", what)
    assert p.returncode == 0 and res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    assert res["raised"] == exc and res["rank"] == res["victim"] == 3, res
    assert f"rank 3 on host {res['victim_host']}" in res["message"]
    assert res["seconds"] < 5.0 and not res["open_after"]
    assert tu.shm_entries(info["prefix"]) == []


def test_local_ctrl_c_while_another_group_computes():
    """Ctrl-C while the master waits in a step's all-reduce for a slow rank of another
    group: KeyboardInterrupt at once, not when that rank is done (the wait is not yet a
    commit), nothing applied, the next step right."""
    p, info, res = run_local(2, "ctrl_c_slow", "4")
    assert p.returncode == 0 and res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    assert res["raised"] == "KeyboardInterrupt" and res["seconds"] < res["sleep_s"] - 0.5, res
    assert res["unchanged"] and res["next_step_right"], res


def test_local_uncaught_exception_ends_the_job():
    t0 = time.monotonic()
    p, info, res = run_local(2, "fault", "4", "raise", timeout=60)
    assert p.returncode != 0 and "synk-test: an uncaught exception" in p.stderr
    assert time.monotonic() - t0 < 30
    assert tu.shm_entries(info["prefix"]) == []


# ---- two simulated hosts ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hosts():
    with simhosts_or_skip().SimHosts(("hA", "hB")) as h:
        yield h


def run_hosts(hosts, *args, timeout=120, env=None, per_host=1):
    return _run_hosts(hosts, "_mpi_scripts.py", *args, timeout=timeout, env=env, per_host=per_host)


# the ranks' backend of a two-host test: numba, or PyTensor's JAX backend on CPU ranks (the
# scenario's own master and every rank of both hosts)
RANKS = [pytest.param(None, id="numba"), pytest.param({"SYNK_MODE": "JAX"}, id="JAX")]


@pytest.mark.parametrize("n", [4, 3, 2], ids=["2-per-host", "2-and-1", "1-per-host"])
@pytest.mark.parametrize("ranks", RANKS)
def test_hosts_every_feature(hosts, ranks, n):
    """Every function feature and collective on two hosts, against numpy: two ranks a host
    (host buffers between the ranks and MPI), one (the host's one rank reduces between
    hosts in its own value buffers), and both at once (hosts that reduce differently must
    still take the same steps: a vote between them once hung)."""
    p, info, res = run_hosts(hosts, "features", str(n), env=ranks)
    assert p.returncode == 0 and res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    hosts_of_ranks = [h for _, h, _ in info["ranks"]]
    assert info["hosts"] == ["hA", "hB"] and hosts_of_ranks == ["hA"] * (n - n // 2) + ["hB"] * (n // 2)
    assert res["failed"] == [], res["failed"]
    assert_hosts_clean(hosts)


@pytest.mark.parametrize("ranks", RANKS)
def test_hosts_in_graph_collectives(hosts, ranks):
    """``synkhronos.ops`` inside graphs run by ranks of two hosts (4 ranks, 7 rows: unequal
    shards): every verb's value, the summed cost and its gradients equal the serial graph's,
    roots other than rank 0 included (a broadcast from rank 1 was refused between hosts); a
    shape mismatch between the hosts' ranks raises and the session goes on."""
    p, info, res = run_hosts(hosts, "in_graph", "4", env=ranks)
    assert p.returncode == 0 and res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    assert res["failed"] == [] and res["checks"] >= 25, res
    assert_hosts_clean(hosts)


def test_hosts_inputs_that_grow_and_shrink(hosts):
    """A function called with inputs of varying sizes, down and up again (arrays, a
    ``synk.data`` resized in place, index batches, ``scatter``, broadcast inputs,
    ``set_value``): on the other
    host, the copies of the master's buffers are resized under the same names, and its
    ranks must read the new ones (they kept the old: a call raised, or read the data of an
    earlier call)."""
    p, info, res = run_hosts(hosts, "sizes", "4")
    assert p.returncode == 0 and res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    assert res["raised"] == [] and res["wrong"] == [], res
    assert_hosts_clean(hosts)


@pytest.mark.parametrize("n", ["auto", "2"], ids=["every-core", "1-per-host"])
def test_hosts_training_equals_serial(hosts, n):
    """20 SGD steps on two hosts equal the serial run's (every core a rank, and one rank a
    host: its gradients' all-reduce between hosts in its own value buffers)."""
    p, info, res = run_hosts(hosts, "train", n, "20")
    assert p.returncode == 0 and res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    assert res["loss_diff"] < 1e-12 and res["param_diff"] < 1e-12 and res["ranks_agree"] == 0.0
    assert_hosts_clean(hosts)


@pytest.mark.parametrize("what,exc,ranks", [("kill", "WorkerDied", None), ("stop", "WorkerStopped", None),
                                            pytest.param("kill", "WorkerDied", {"SYNK_MODE": "JAX"}, id="kill-JAX",
                                                         marks=pytest.mark.slow)])
def test_hosts_rank_lost_on_the_other_host(hosts, what, exc, ranks):
    p, info, res = run_hosts(hosts, "fault", "4", what, env=ranks)
    assert p.returncode == 0 and res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    assert res["raised"] == exc and res["rank"] == 3 and res["host"] == "hB", res
    assert "rank 3 on host hB" in res["message"] and res["seconds"] < 5.0
    # the flight recorder's report, printed before the error: every rank of both hosts (the
    # other host's from its agent), the lost one marked
    out = p.stdout + p.stderr
    assert "synkhronos flight recorder when rank 3 was lost" in out, out[-3000:]
    report = out.split("synkhronos flight recorder when rank 3 was lost")[1]
    for rank, host in ((0, "hA"), (1, "hA"), (2, "hB"), (3, "hB")):
        assert f"rank {rank} ({host}, pid" in report, report
    assert ("STOPPED" if what == "stop" else "GONE") in report.split("rank 3 (hB")[1].split("\n")[0], report
    assert_hosts_clean(hosts)


@pytest.mark.parametrize("what,ranks", [("kill", None), ("stop", None),
                                        pytest.param("kill", {"SYNK_MODE": "JAX"}, id="kill-JAX")])
def test_hosts_rank_lost_after_its_neighbour_quit(hosts, what, ranks):
    """A rank of the other host killed (or left frozen) during ``synk.close()``, after the
    other rank of its host answered "quit" and exited: its agent reports it (a clean exit
    after "quit" is no loss, and did not use up the agent's one report), so the close gives
    up waiting at once (a frozen rank: once seen frozen) instead of after its 5 s limit, and
    nothing is left on either host."""
    p, info, res = run_hosts(hosts, "close_lost", "4", what, env=ranks)
    assert p.returncode == 0 and res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    assert res["victim"] == 3 and res["victim_host"] == "hB", res
    assert res["raised"] is None and not res["open_after"], res
    assert res["seconds"] < 4.0, res
    assert_hosts_clean(hosts)


def test_hosts_broadcast_root_lost(hosts):
    """The root of an in-graph broadcast (rank 3: not the first rank of the other host) is
    killed while every other rank waits for it inside the broadcast: WorkerDied naming it at
    once, the session closed on both hosts, nothing left (roots 1 and 2, SIGSTOP and JAX
    ranks pass too, by hand)."""
    p, info, res = run_hosts(hosts, "root_lost", "4", "3", "kill")
    assert p.returncode == 0 and res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    assert res["raised"] == "WorkerDied" and res["rank"] == 3 and res["host"] == "hB", res
    assert res["seconds"] < 5.0 and not res["open_after"], res
    assert_hosts_clean(hosts)


def test_hosts_many_small_collectives_under_load(hosts):
    """150 cross-host averages in a row beside a busy loop, two MPI processes on each host,
    each right to the last bit: a host seen finished while the master's part of the
    operation still waits for MPI's progress is not taken for one that never joins (it was:
    1 call in ~7 failed so; 1 in ~1000 with one MPI process a host)."""
    p, info, res = run_hosts(hosts, "repeat", "4", "150", per_host=2)
    assert p.returncode == 0 and res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    assert res["errors"] == [] and res["exact"], res
    assert_hosts_clean(hosts)


def test_hosts_uneven_collectives(hosts):
    """A scan whose length differs between the ranks of two hosts (the longer ones: rank 0
    alone, the master's host, the other host): each call ends within seconds with an error
    naming who finished (a rank waiting in a collective, a host waiting between hosts, or
    the master seeing the other host's ranks wait), not a wait for ever; nothing applied,
    the session goes on, nothing left."""
    p, info, res = run_hosts(hosts, "uneven", "4")
    assert p.returncode == 0 and res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    for case in ("rank 0", "the master's host", "the other host"):
        what, seconds = res[case]
        assert "different numbers of collectives" in what and seconds < 10, (case, res)
    assert res["unchanged"] and res["after"] == [2.0 * res["n"]] * 3, res
    assert_hosts_clean(hosts)


@pytest.mark.parametrize("ranks,n", [pytest.param(None, 4, id="numba"), pytest.param(None, 3, id="numba-2-and-1"),
                                     pytest.param(None, 2, id="numba-1-per-host"),
                                     pytest.param(RANKS[1].values[0], 4, id="JAX", marks=pytest.mark.slow)])
def test_hosts_sigint_storm(hosts, ranks, n):
    """test_faults_master's SIGINT storm on 4 ranks over two hosts (and on 3, and on 2: one a
    host, whose reductions between hosts work in the rank's own value buffers): calls, training steps
    (plain, fp16, and a gradient that lies in the shared-memory slots) and collectives
    interrupted at random instants; every completed result right, every interrupted one all
    or nothing on every rank of both hosts, nothing left on either host."""
    p, info, res = _run_hosts(hosts, "_fault_scripts.py", "sigint_storm", "200", str(n), "150", timeout=300,
                              env=ranks)
    assert p.returncode == 0 and res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    # (enough operations complete between the interrupts to check values: JAX ranks' are
    # slower, and under load ~80 of 280 completed there)
    assert res["interrupts"] >= 200 and res["completed"] > (50 if ranks else 100), res
    assert res["mismatches"] == [], res["mismatches"]
    assert res["inconsistent"] == [], res["inconsistent"]
    assert res["final_f"] == 45.0 and res["left"] == []
    assert_hosts_clean(hosts)


def test_hosts_step_fails_on_the_other_host(hosts):
    """A training step whose gradient raises in a rank of the other host, before the step's
    all-reduce between hosts: WorkerError naming it at once (it hung: the master waited for
    the MPI operation that host never joined), nothing applied, the next step right."""
    p, info, res = run_hosts(hosts, "step_fails", "4")
    assert p.returncode == 0 and res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    assert res["raised"] == "WorkerError" and "rank 3" in res["message"] and res["seconds"] < 5.0, res
    assert res["moved"] and res["ranks_agree"] and res["unchanged"] and res["next_step_right"], res
    assert_hosts_clean(hosts)


@pytest.mark.parametrize("ranks", [RANKS[0], pytest.param(RANKS[1].values[0], id="JAX", marks=pytest.mark.slow)])
def test_hosts_parameter_server(hosts, ranks):
    """The asynchronous parameter server with workers on both hosts (rank 1 on the master's
    host, ranks 2 and 3 on the other, rank 3 slowed): it trains (on JAX ranks it once did
    not: every gradient "applied", the weights never moved), every applied gradient is
    within the staleness bound, the counts add up, the slow worker stalls nobody, each
    gradient and each answer crosses between the hosts once, Ctrl-C stops a run."""
    p, info, res = run_hosts(hosts, "ps", "4", "run", env=ranks)
    assert p.returncode == 0 and res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    assert res["remote"] == [2, 3] and res["slow_rank"] == 3
    per = {int(r): v for r, v in res["per_rank"].items()}
    assert sorted(per) == [1, 2, 3]
    assert res["loss_after"] < 0.9 * res["loss_before"], res
    # every worker computed on its own rows (the other host's shipped with the command): on
    # rows it never got (zeros) its loss would be log(4) = 1.386 throughout
    assert all(v < 1.25 for v in res["loss_by_rank"].values()), res["loss_by_rank"]
    assert len(res["staleness"]) == res["applied"] == sum(v["applied"] for v in per.values())
    assert res["dropped"] == sum(v["dropped"] for v in per.values())
    assert all(0 <= s <= res["max_staleness"] for s in res["staleness"])
    assert all(v["sent"] == v["applied"] + v["dropped"] and v["max_staleness"] <= res["max_staleness"]
               for v in per.values())
    assert all(res["workers"][str(r)]["sent"] >= per[r]["sent"] for r in per)
    # the slowed worker (a gradient per 0.4 s) stalled nobody, on either host; it is reported
    # slow (nothing for 0.1 s): every gap of it holds 0.3 s past that, and the server looks
    # every 0.25 s (with 0.15 s gaps a look fell past the gap's first 0.1 s only by chance)
    slow = per[3]
    assert slow["sent"] <= res["seconds"] / res["SLOW"] + 2
    assert per[1]["applied"] > 5 * (slow["sent"] + 1) and per[2]["applied"] > 5 * (slow["sent"] + 1), per
    assert 3 in [r for r, _, _ in res["slow"]]
    # bytes into / out of the master's host: one message per gradient of ranks 2 and 3 (at
    # most one more per worker was in flight at the end), one per answer (+ the first ones)
    msg = res["nbytes"] + 64
    ups = per[2]["sent"] + per[3]["sent"]
    rx, tx = res["net"]
    assert ups * msg <= rx <= 1.25 * (ups + 2) * msg + 200_000, (rx, ups, msg)
    assert (ups + 2) * msg <= tx <= 1.25 * (ups + 4) * msg + 200_000, (tx, ups, msg)
    assert res["weights_equal"]
    assert res["second_applied"] == res["second_version"] == 20
    assert res["interrupted"] and res["interrupt_seconds"] < 3.0 and res["after_interrupt"] == 5
    assert_hosts_clean(hosts)


@pytest.mark.parametrize("what,exc", [("kill", "WorkerDied"),
                                      pytest.param("stop", "WorkerStopped", marks=pytest.mark.slow)])
def test_hosts_parameter_server_lost_worker(hosts, what, exc):
    """A worker of the other host killed (frozen) during a run: reported, the others (its
    host's too) go on, then the run raises WorkerDied (WorkerStopped) naming rank and host,
    and every host is left clean."""
    p, info, res = run_hosts(hosts, "ps", "4", what)
    assert p.returncode == 0 and res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    assert res["raised"] == exc and res["rank"] == 3 and res["host"] == "hB", res
    assert "rank 3 on host hB" in res["message"] and not res["open_after"]
    assert res["seconds"] < 8.0 and res["staleness_ok"]
    reports = res["dead"] if what == "kill" else res["slow"]
    assert [r for r, _, _ in reports] == [3] and res["lost_at"] < 2.0, res
    assert res["applied_after"]["1"] > 10 and res["applied_after"]["2"] > 10, res["applied_after"]
    assert_hosts_clean(hosts)


def test_hosts_parameter_server_raising_worker(hosts):
    """A worker of the other host whose gradient raises ends the run at once: WorkerError
    naming it, every rank on both hosts given the server's weights, the session goes on."""
    p, info, res = run_hosts(hosts, "ps", "4", "raise")
    assert p.returncode == 0 and res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    assert res["raised"] == "WorkerError" and res["ranks"] == [3], res
    assert "NaN in this worker's rows" in res["message"] and res["has_result"]
    assert res["seconds"] < 4.0 and res["weights_equal"] and res["open_after"] and res["after"] == 10, res
    assert_hosts_clean(hosts)


def test_hosts_uncaught_exception_ends_the_job(hosts):
    t0 = time.monotonic()
    p, info, res = run_hosts(hosts, "fault", "4", "raise", timeout=60)
    assert p.returncode != 0 and "synk-test: an uncaught exception" in p.stdout + p.stderr
    assert time.monotonic() - t0 < 30
    assert_hosts_clean(hosts)


@pytest.mark.parametrize("n,env,says", [
    ("1", None, "is less than the 2 MPI processes"),
    ("4", {"SYNK_MODE": "JAX", "SYNK_JAX_COMM": "xla"}, "XLA's collectives cannot be used: ranks on several hosts")],
    ids=["too-few-ranks", "JAX-xla-between-hosts"])
def test_hosts_refused_fork_ends_the_job_cleanly(hosts, n, env, says):
    """``synk.fork()`` refused in the master under mpiexec (fewer ranks than hosts; XLA's
    collectives asked for between hosts): the error is printed, the agents are told to
    exit, the job ends, and no host keeps anything (MPICH's own files included: no
    MPI_Abort)."""
    t0 = time.monotonic()
    p, info, res = run_hosts(hosts, "fault", n, "fork_error", timeout=60, env=env)
    assert p.returncode != 0 and says in p.stdout + p.stderr, (p.stdout + p.stderr)[-2000:]
    assert time.monotonic() - t0 < 30
    assert_hosts_clean(hosts)


@pytest.mark.parametrize("n", [4, 2], ids=["2-per-host", "1-per-host"])
def test_hosts_master_killed_ends_everything(hosts, n):
    """SIGKILL of the master: MPICH ends every MPI process; the workers on both hosts see
    their host's MPI process gone, exit, and free their host's shared memory (MPICH's file
    included); with one rank a host the master's host has no worker to do it."""
    out = f"/tmp/synk-mpi-{os.getpid()}-{time.monotonic_ns()}.jsonl"
    cmd = hosts.mpiexec_cmd(2, 1, [sys.executable, SCRIPT, "fault", str(n), "idle"], extra=("-prepend-rank",),
                            env={"SYNK_RESULT_FILE": out})
    p = hosts.popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ready = tu.wait_until(lambda: os.path.exists(out) and '"ready"' in open(out).read(), 120)
        assert ready, "the program did not get ready"
        info, _ = parse(open(out).read())
        os.kill(info["ranks"][0][2], signal.SIGKILL)
        t0 = time.monotonic()
        p.wait(timeout=30)
        workers = [pid for _, _, pid in info["ranks"][1:]]
        assert tu.wait_until(lambda: not any(tu.pid_running(w) for w in workers), 5.0)
        assert_hosts_clean(hosts)
        assert time.monotonic() - t0 < 10
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        hosts.kill_all()
        hosts.clear_shm()
        if os.path.exists(out):
            os.unlink(out)


def test_hosts_checkpoint_and_timeline(hosts, tmp_path):
    """A checkpoint written by a session on this host resumes on two hosts (2 ranks -> 4),
    whose run writes a timeline of every rank of both hosts and a checkpoint that resumes
    here again at one rank; the losses and parameters continue those of the run that was
    not interrupted, to rounding.  Each rank's random generator goes along: ranks 0 and 1
    of both hosts continue the saved ranks' streams, ranks 2 and 3 draw their own, and the
    rank of the last session continues rank 0's."""
    import json

    import numpy as np

    import synkhronos as synk
    from _mpi_faults import ckpt_model, ckpt_noise
    ck, trace = str(tmp_path / "ck.npz"), str(tmp_path / "trace.json")
    tu.fork(2)
    try:
        step, params, X, Y = ckpt_model()
        noise = ckpt_noise()
        synk.distribute()
        for _ in range(3):
            step(X, Y)
        noise()
        synk.save(ck, state={"step": 3})
        ref_drawn = noise().reshape(2, 2)
        ref = [float(step(X, Y)) for _ in range(4)]
        ref_params = [p.get_value() for p in params]
    finally:
        synk.close()
    p, info, res = run_hosts(hosts, "resume", ck, trace, "4")
    assert p.returncode == 0 and res is not None, p.stdout[-3000:] + p.stderr[-3000:]
    assert info["hosts"] == ["hA", "hB"] and res["n"] == 4
    np.testing.assert_allclose(res["losses"], ref, rtol=1e-10)
    drawn = np.reshape(res["drawn"], (4, 2))
    np.testing.assert_array_equal(drawn[:2], ref_drawn)
    assert len({tuple(row) for row in drawn}) == 4 and np.isfinite(drawn).all()
    events = json.load(open(trace))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names) == [0, 1, 2, 3], names
    assert [names[r].split("(")[1].split(",")[0] for r in range(4)] == ["hA", "hA", "hB", "hB"], names
    for r in range(4):
        assert sum(e["name"] == "call of function train_grad" and e["pid"] == r for e in events) == 4
    tu.fork(1)
    try:
        step, params, X, Y = ckpt_model()
        noise = ckpt_noise()
        synk.distribute()
        assert synk.load(ck + ".out") == {"from": {"step": 3}, "ranks": 4}
        for p_, q in zip(params, ref_params):
            np.testing.assert_allclose(p_.get_value(), q, rtol=1e-10)
        np.testing.assert_array_equal(noise(), np.reshape(res["drawn_after"], (4, 2))[0])
    finally:
        synk.close()
    assert_hosts_clean(hosts)


def test_hosts_elastic_whole_host_lost(hosts, tmp_path):
    """``elastic.run(checkpoint=...)`` on two hosts loses the second host (its MPI process
    killed: MPICH ends the job, every process on both hosts ends); the same script started
    again on the host left goes on from the last commit on disk and ends where a run that
    lost nothing ends (the same global batches: to rounding)."""
    import numpy as np

    import synkhronos as synk
    from _mpi_faults import ckpt_model
    ck = str(tmp_path / "elastic.npz")
    out = str(tmp_path / "progress.jsonl")
    cmd = hosts.mpiexec_cmd(2, 1, [sys.executable, SCRIPT, "elastic", ck, "12", "0.3"], extra=("-prepend-rank",),
                            env={"SYNK_RESULT_FILE": out})
    p = hosts.popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        assert tu.wait_until(lambda: os.path.exists(out) and '"step": 5' in open(out).read(), 180), \
            open(out).read() if os.path.exists(out) else "no progress"
        agent = [pid for pid, cmd in hosts.processes("hB") if "_mpi_scripts.py" in cmd]
        assert len(agent) == 1, hosts.processes()
        os.kill(agent[0], signal.SIGKILL)
        p.wait(timeout=60)
        assert p.returncode != 0
        assert_hosts_clean(hosts)
    finally:
        if p.poll() is None:
            p.kill()
    progress = open(out).read()
    assert '"step": 12' not in progress and '"n": 4' in progress
    p2, _, res = run_local(1, "elastic", ck, "12", "0", timeout=180)
    assert p2.returncode == 0 and res is not None, p2.stdout[-3000:] + p2.stderr[-3000:]
    assert res["started_at"] in (4, 6), res["started_at"]
    tu.fork(2)
    try:
        step, params, X, Y = ckpt_model()
        synk.distribute()
        ref = [float(step(X, Y)) for _ in range(12)]
        ref_params = [p_.get_value() for p_ in params]
    finally:
        synk.close()
    np.testing.assert_allclose(res["losses"], ref, rtol=1e-10)
    for got, want in zip(res["params"], ref_params):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-10)
