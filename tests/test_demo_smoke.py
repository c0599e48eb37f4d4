"""Smoke test of demos/mnist_mlp.py: a tiny configuration, one short epoch, as a subprocess.

The graphs are the same as the default demo's (only sizes differ), so after one run (or a
demo run) the JIT comes from the on-disk cache and each case takes seconds."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "demos", "mnist_mlp.py")


@pytest.mark.parametrize("pattern", ["batch", "scatter"])
def test_demo_one_short_epoch(pattern):
    pytest.importorskip("sklearn")
    cmd = [sys.executable, DEMO, "--n-parallel", "2", "--epochs", "1", "--max-steps", "12",
           "--batch-size", "64", "--hidden", "64", "--learning-rate", "0.01",
           "--data-pattern", pattern, "--no-progress"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, cwd=ROOT)
    out = proc.stdout
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{out}\n{proc.stderr[-3000:]}"
    m = re.search(r"epoch\s+1/1\s+loss ([0-9.]+) -> ([0-9.]+)", out)
    assert m, f"no epoch line in the output:\n{out}"
    first, last = float(m.group(1)), float(m.group(2))
    assert last < 0.9 * first, f"loss did not fall: {first} -> {last}\n{out}"
    m = re.search(r"RESULT: test accuracy ([0-9.]+) \| time/epoch: plain PyTensor ([0-9.]+) s .*"
                  r"synkhronos \(2 ranks\) ([0-9.]+) s \| speedup ([0-9.]+)x over PyTensor on all "
                  r"cores, ([0-9.]+)x over one core", out)
    assert m, f"no RESULT line in the output:\n{out}"
    assert float(m.group(1)) > 0.3          # 10 classes: chance is 0.1
    # the serial baseline saw the same batches: same final loss up to float32 rounding
    m = re.search(r"final loss ([0-9.]+) vs ([0-9.]+)", out)
    assert m and abs(float(m.group(1)) - float(m.group(2))) < 1e-3, out
