"""GPU ranks, each scenario in a fresh master process (``tests/_gpu_script.py``): one GPU
rank (values stay in GPU memory, the hot path moves nothing implicitly), two ranks on one
GPU (NCCL refuses that: collectives go through the host, with one warning saying why),
in-graph collectives in a JAX-compiled graph, the matmul precision (TF32 said in the
banner; ``matmul_precision="highest"`` gives float32 results), and with two GPUs or more
XLA's collectives (NCCL) against numpy and a worker killed inside one; a checkpoint of CPU
ranks resumed on the GPU and back.  Run by
``benchmarks/gpu_check.sh`` on a GPU machine; skipped where no GPU can be used.  The same
scenarios run on JAX CPU ranks everywhere (``SYNK_GPU_SCRIPT_CPU=1``), so that the script
a GPU machine runs is known to work."""
import json
import os
import subprocess
import sys

import pytest

import synkhronos as synk

N_GPU = synk.get_n_gpu()
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_gpu_script.py")
needs_gpu = pytest.mark.skipif(N_GPU == 0, reason="no usable GPU (needs a GPU and the gpu extra)")
SCENARIOS = ["one_rank", "two_on_one", "in_graph", "precision", "checkpoint"]


def run(scenario, cpu=False, timeout=300):
    pytest.importorskip("jax")
    env = dict(os.environ)
    env.pop("SYNK_MODE", None)
    env.pop("SYNK_GPUS", None)
    if cpu:
        env["SYNK_GPU_SCRIPT_CPU"] = "1"
    p = subprocess.run([sys.executable, SCRIPT, scenario], capture_output=True, text=True, timeout=timeout,
                       env=env)
    assert p.returncode == 0 and "DONE" in p.stdout, (
        f"{scenario} exited {p.returncode}\n--- stdout\n{p.stdout[-3000:]}\n--- stderr\n{p.stderr[-5000:]}")
    res = [json.loads(ln[len("RESULT "):]) for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    return res[-1], p.stdout, p.stderr


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_scenarios_on_jax_cpu_ranks(scenario):
    res, out, err = run(scenario, cpu=True)
    assert "warning" not in err.lower(), err[-3000:]
    if "platform" in res:
        assert res["platform"] == "cpu"


@needs_gpu
def test_one_gpu_rank_keeps_values_on_the_gpu():
    res, _, err = run("one_rank")
    assert res["platform"] == "gpu"
    assert "warning" not in err.lower(), err[-3000:]     # (one GPU rank: no word about NCCL either)


@needs_gpu
def test_two_ranks_on_one_gpu_go_through_the_host():
    res, _, err = run("two_on_one")
    assert res["platform"] == "gpu"
    assert err.count("not NCCL") == 1 and "share a GPU" in err, err[-3000:]


@needs_gpu
def test_in_graph_collectives_on_gpus():
    res, _, _ = run("in_graph")
    assert res["n"] == 2


@needs_gpu
def test_precision_said_and_set():
    res, out, _ = run("precision")
    assert "float32 matmuls at precision 'highest'" in out
    assert res["max_rel_error"] < 1e-5


@needs_gpu
def test_checkpoint_from_cpu_ranks_onto_the_gpu_and_back():
    res, _, _ = run("checkpoint")
    assert res["max_abs_diff"] < 1e-5


@needs_gpu
@pytest.mark.skipif(N_GPU < 2, reason="XLA's collectives (NCCL) need two GPUs")
def test_nccl_collectives_against_numpy():
    from test_jax_xla_comm import run as run_xla
    res = run_xla("values", 2, env={"SYNK_XLA_TEST_GPU": "1"})
    assert res["checked"] == 40 and res["picked"]["all_reduce float32 sum"] == "xla"


@needs_gpu
@pytest.mark.skipif(N_GPU < 2, reason="XLA's collectives (NCCL) need two GPUs")
def test_nccl_worker_killed_inside_a_collective():
    from test_jax_xla_comm import run as run_xla
    res = run_xla("kill_in_collective", 2, timeout=120, env={"SYNK_XLA_TEST_GPU": "1"})
    assert res["error"] == "WorkerDied"


@needs_gpu
def test_gpu_count_matches_jax():
    """The count read from the driver (no CUDA in this process) against JAX's own, in a
    separate process."""
    out = subprocess.run([sys.executable, "-c", "import jax; print(len(jax.devices('gpu')))"],
                         capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip().splitlines()[-1]) == N_GPU
