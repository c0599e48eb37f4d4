"""demos/partial_fc.py, tiny, at 2 ranks: the class-sharded classifier trained with in-graph
collectives ends where the serial full model ends (float64: to rounding), as a subprocess
(its own session; the module's leak check covers it); on numba ranks and on JAX CPU ranks
(``SYNK_MODE=JAX``: the graph compiles in jitted stretches between its collectives)."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "demos", "partial_fc.py")


@pytest.mark.parametrize("backend", ["numba", "JAX"])
def test_partial_fc_matches_serial(backend):
    pytest.importorskip("sklearn")
    if backend == "JAX":
        pytest.importorskip("jax")
    cmd = [sys.executable, DEMO, "--n-parallel", "2", "--steps", "8", "--batch-size", "32",
           "--hidden", "16", "--embed", "8", "--float64"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("SYNK_MODE", None)
    if backend == "JAX":
        env["SYNK_MODE"] = "JAX"
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    out = proc.stdout
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{out}\n{proc.stderr[-3000:]}"
    if backend == "JAX":
        assert "Warning" not in proc.stderr, proc.stderr[-3000:]
    assert "classes per rank [5, 5]" in out, out
    assert re.search(r"identical on every rank: max spread 0\.0e\+00", out), out
    m = re.search(r"RESULT: partial FC 2 rank\(s\), 10 classes, float64, 8 steps: test accuracy "
                  r"([0-9.]+) \(serial ([0-9.]+)\); max \|parameter difference\| vs serial ([0-9.e+-]+)", out)
    assert m, f"no RESULT line:\n{out}"
    assert m.group(1) == m.group(2), out
    assert float(m.group(3)) < 1e-12, out
    loss = re.findall(r"final training loss ([0-9.]+) \(serial ([0-9.]+)\)", out)
    assert loss and loss[0][0] == loss[0][1], out
