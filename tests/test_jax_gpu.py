"""GPU ranks (skipped where no GPU can be used: ``synk.get_n_gpu() == 0``).  Run by
``benchmarks/gpu_check.sh`` on a GPU machine: one GPU rank (values stay in GPU memory, the
hot path moves nothing implicitly), two ranks on one GPU (NCCL refuses that: collectives go
through the host, with one warning saying why), and with two GPUs or more XLA's collectives
(NCCL) against numpy and a worker killed inside one.  Not verified on a GPU yet."""
import os

import numpy as np
import pytest
import pytensor
import pytensor.tensor as T

import synkhronos as synk

N_GPU = synk.get_n_gpu()
pytestmark = pytest.mark.skipif(N_GPU == 0, reason="no usable GPU (needs a GPU and the gpu extra)")


def _platform(var):
    import jax
    value = var.container.storage[0]
    assert isinstance(value, jax.Array)
    return next(iter(value.devices())).platform


def _graph():
    x = T.matrix("x", dtype="float32")
    w = pytensor.shared(np.ones(3, "float32"), name="w")
    f = synk.function([x], [(x.dot(w).sum(), "sum")], updates=[(w, w + T.mean(x, axis=0))])
    return f, w


def test_one_gpu_rank_keeps_values_on_the_gpu():
    import jax
    synk.fork(1, use_gpu=True)
    try:
        f, w = _graph()
        synk.distribute()
        X = np.ones((4, 3), "float32")
        xd = synk.data(X)
        f(xd)
        assert _platform(w) == "gpu"
        with jax.transfer_guard("disallow"):
            out = f(xd)
            synk.all_reduce(w, "sum")
        assert out[0].dtype == np.float32 and _platform(w) == "gpu"
        np.testing.assert_allclose(synk.get_value(0, w), 3.0)
    finally:
        synk.close()


def test_two_ranks_on_one_gpu_go_through_the_host(monkeypatch, capfd):
    monkeypatch.setenv("SYNK_GPUS", "0,0")
    synk.fork(use_gpu=True)
    try:
        f, w = _graph()
        synk.distribute()
        for r in range(2):
            synk.set_value(r, w, np.full(3, r + 1, "float32"))
        synk.all_reduce(w, "sum")
        synk.all_reduce(w, "avg")
        np.testing.assert_allclose(synk.gather(w), 3.0)
        assert _platform(w) == "gpu"
        err = capfd.readouterr().err
        assert err.count("not NCCL") == 1 and "share a GPU" in err
    finally:
        synk.close()


@pytest.mark.skipif(N_GPU < 2, reason="XLA's collectives (NCCL) need two GPUs")
def test_nccl_collectives_against_numpy():
    from test_jax_xla_comm import run
    res = run("values", 2, env={"SYNK_XLA_TEST_GPU": "1"})
    assert res["checked"] == 40 and res["picked"]["all_reduce float32 sum"] == "xla"


@pytest.mark.skipif(N_GPU < 2, reason="XLA's collectives (NCCL) need two GPUs")
def test_nccl_worker_killed_inside_a_collective():
    from test_jax_xla_comm import run
    res = run("kill_in_collective", 2, timeout=120, env={"SYNK_XLA_TEST_GPU": "1"})
    assert res["error"] == "WorkerDied"


def test_gpu_count_matches_jax():
    """The count read from the driver (no CUDA in this process) against JAX's own, in a
    separate process."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", "import jax; print(len(jax.devices('gpu')))"],
                         capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip().splitlines()[-1]) == N_GPU
