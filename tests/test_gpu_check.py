"""``benchmarks/gpu_check.sh`` on a lent machine's short lease: ``--budget`` skips a stage
that has no time left and lists it, ``--out`` gets the run's log, a malformed budget is
refused before anything runs (the stages themselves are the benchmarks': not run here)."""
import os
import subprocess

import synk_testutil as tu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.sh")


def _run(*args, results=None):
    env = tu.program_env()
    env["CUDA_VISIBLE_DEVICES"] = ""            # (CPU mode, whatever the machine has)
    if results is not None:
        env["GPU_CHECK_RESULTS"] = str(results)  # (never the repository's own results)
    return subprocess.run(["bash", SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_budget_skips_what_does_not_fit_and_out_gets_the_log(tmp_path):
    out = tmp_path / "out"
    p = _run("--no-tests", "--no-measure", "--demos", "--gpu-demos", "--budget", "1", "--out", str(out),
             results=tmp_path / "results")
    text = p.stdout + p.stderr
    assert p.returncode == 0, text[-3000:]
    assert "== demos: skipped" in text and "== gpu-demos: skipped" in text, text[-3000:]
    assert "not run for lack of time (--budget 1)" in text, text[-3000:]
    log = (out / "gpu_check_cpu.log").read_text()
    assert "demos (needs ~60 s" in log and "gpu-demos (needs ~60 s" in log, log
    assert log == (tmp_path / "results" / "gpu_check_cpu.log").read_text()


def test_a_malformed_budget_is_refused(tmp_path):
    p = _run("--no-tests", "--no-measure", "--budget", "ten", results=tmp_path)
    assert p.returncode == 2 and "--budget takes whole seconds" in p.stderr, p.stderr
    p = _run("--budget", results=tmp_path)
    assert p.returncode == 2 and "--budget needs a value" in p.stderr, p.stderr
