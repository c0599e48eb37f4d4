"""Smoke tests of demos/mnist_cnn.py (both data patterns) and demos/resnet.py: a tiny
configuration, one short epoch, as a subprocess at two ranks.

The models are pytensor-ml's layers (demos/layers.py).  Most of a run is the numba JIT of
the gradient graph on a cold cache (tens of seconds per graph, more for the ResNet), so the
smoke models are shallow: one conv stage for the CNN, one stage of one basic block for the
ResNet.  Once the on-disk cache holds them each case takes a few seconds.

Each demo runs again on JAX CPU ranks (``SYNK_MODE=JAX``: PyTensor's JAX backend, with the
JAX conversions synkhronos ships for pytensor-ml's window ops and shape arithmetic), and
reaches the accuracy it reached on numba ranks."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMOS = os.path.join(ROOT, "demos")

RESULT = re.compile(r"RESULT: test accuracy ([0-9.]+) \| time/epoch: plain PyTensor(?: JAX)? ([0-9.]+) s .*"
                    r"synkhronos \(2 ranks\) ([0-9.]+) s \| speedup ([0-9.]+)x over PyTensor on all "
                    r"cores, ([0-9.]+)x over one core")


BACKENDS = ["numba", "JAX"]
ACCURACY = {}          # (demo, backend) -> test accuracy, to compare the backends


def run_demo(script, *args, backend="numba"):
    pytest.importorskip("sklearn")
    pytest.importorskip("pytensor_ml")
    if backend == "JAX":
        pytest.importorskip("jax")
    cmd = [sys.executable, os.path.join(DEMOS, script), "--n-parallel", "2", "--epochs", "1",
           "--no-progress", *args]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("SYNK_MODE", None)
    if backend == "JAX":
        env["SYNK_MODE"] = "JAX"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, cwd=ROOT)
    out = proc.stdout
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{out}\n{proc.stderr[-3000:]}"
    if backend == "JAX":                  # no JAX or PyTensor warning the user cannot act on
        assert "Warning" not in proc.stderr, proc.stderr[-3000:]
    m = re.search(r"epoch\s+1/1\s+loss ([0-9.]+) -> ([0-9.]+)", out)
    assert m, f"no epoch line in the output:\n{out}"
    first, last = float(m.group(1)), float(m.group(2))
    assert last < 0.9 * first, f"loss did not fall: {first} -> {last}\n{out}"
    m = RESULT.search(out)
    assert m, f"no RESULT line in the output:\n{out}"
    acc = ACCURACY[(script, " ".join(args), backend)] = float(m.group(1))
    other = ACCURACY.get((script, " ".join(args), "numba"))
    if backend == "JAX" and other is not None:      # the same training on another backend
        assert abs(acc - other) <= 0.02, f"JAX ranks reached {acc}, numba ranks {other}\n{out}"
    return out, acc


@pytest.mark.parametrize("backend,pattern", [pytest.param("numba", "batch", marks=pytest.mark.slow),
                                             ("numba", "scatter"), ("JAX", "batch")])
def test_mnist_cnn_one_short_epoch(backend, pattern):
    out, acc = run_demo("mnist_cnn.py", "--max-steps", "12", "--batch-size", "64", "--channels", "8",
                        "--hidden", "32", "--learning-rate", "0.02", "--data-pattern", pattern,
                        backend=backend)
    assert acc > 0.3, out                   # 10 classes: chance is 0.1
    # no batch norm: the serial baseline saw the same batches, so it reached the same loss
    m = re.search(r"final loss ([0-9.]+) vs ([0-9.]+)", out)
    assert m and abs(float(m.group(1)) - float(m.group(2))) < 1e-3, out


@pytest.mark.parametrize("backend", BACKENDS)
def test_resnet_one_short_epoch(backend):
    out, acc = run_demo("resnet.py", "--max-steps", "12", "--batch-size", "64", "--width", "16",
                        "--blocks", "1", "--learning-rate", "0.03", backend=backend)
    assert "batch norm after every conv" in out
    assert acc > 0.1, out
