"""Smoke test of demos/mnist_mlp.py: a tiny configuration, one short epoch, as a subprocess.

The graphs are the same as the default demo's (only sizes differ), so after one run (or a
demo run) the JIT comes from the on-disk cache and each case takes seconds."""
import importlib
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


@pytest.mark.parametrize("pattern", ["batch", "scatter"])
def test_serial_runs_take_turns(pattern):
    """The serial runs take turns with the data-parallel epochs (3 epochs each, the rest at
    the end) and each still trains as if alone: after 4 epochs all three runs end within
    float32 rounding (with the scatter pattern the serial steps set the master's shard
    of the data, which a turn must give back)."""
    pytest.importorskip("sklearn")
    cmd = [sys.executable, DEMO, "--n-parallel", "2", "--epochs", "4", "--max-steps", "3",
           "--batch-size", "64", "--hidden", "64", "--learning-rate", "0.01",
           "--data-pattern", pattern, "--no-progress"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=ROOT,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    out = proc.stdout
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{out}\n{proc.stderr[-3000:]}"
    order = [m.group(1).strip() for m in (re.match(r"(epoch\s+\d/4|  serial, epochs? [0-9-]+)", ln)
                                          for ln in out.splitlines()) if m]
    assert order == ["epoch   1/4", "epoch   2/4", "epoch   3/4", "serial, epochs 1-3", "epoch   4/4",
                     "serial, epoch 4"], out
    times = re.search(r"serial, epochs 1-3: ([0-9., ]+) s \(2 threads\); ([0-9., ]+) s \(1 thread\)", out)
    assert times and all(len(t.split(", ")) == 3 for t in times.groups()), out
    m = re.search(r"max \|param difference\| ([0-9.e+-]+) and ([0-9.e+-]+)", out)
    assert m and max(map(float, m.groups())) < 1e-4, out


@pytest.mark.parametrize("script", ["mnist_mlp.py", "mnist_cnn.py", "resnet.py"])
def test_demo_help_states_each_default_once(script):
    """``--help`` answers at once (nothing heavy imported) and every option's help says its
    default exactly once, never as "(default: None)"."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "demos", script), "--help"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "default: None" not in text and "default: False" not in text, text
    options = text.split("\noptions:\n")[1].split("\nexamples:\n")[0]
    entries = re.split(r"\n  (?=-)", "\n" + options.strip("\n"))
    entries = [e for e in entries if e.strip() and not e.lstrip().startswith("-h, --help")]
    assert len(entries) >= 13, entries
    for e in entries:
        name = e.split()[0]
        n = e.count("default")
        if name in ("--float64", "--no-progress", "--resnet50"):
            assert n <= 1, e                 # flags: off unless given
        else:
            assert n == 1, f"{name}: 'default' {n} times:\n{e}"
    for name in ("--epochs", "--data-pattern"):
        entry = next(e for e in entries if e.split()[0] == name)
        assert len(" ".join(entry.split()[2:])) > 20, entry     # a real help text


def test_demo_output_has_no_bad_plurals_or_carriage_returns():
    """One rank: "1 rank", never "1 ranks"; stderr not a terminal: no tqdm carriage returns."""
    pytest.importorskip("sklearn")
    cmd = [sys.executable, DEMO, "--n-parallel", "1", "--epochs", "1", "--max-steps", "3",
           "--batch-size", "64", "--hidden", "64", "--learning-rate", "0.01"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280, env=env, cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-3000:]}"
    out = proc.stdout
    assert "synkhronos (1 rank)" in out and "synkhronos (1 rank," in out, out
    assert not re.search(r"\b1 (ranks|threads|epochs)\b", out), out
    assert "\r" not in proc.stdout + proc.stderr


def _demo_module(name):
    sys.path.insert(0, os.path.join(ROOT, "demos"))
    return importlib.import_module(name)


def test_harness_progress_lines_and_load_verdict():
    """Off a terminal the loops print plain lines (no carriage returns); the RESULT caveat
    appears exactly when other programs used at least 10% of the CPU."""
    import io
    import time

    from synkhronos import machine_load
    display, report = _demo_module("display"), _demo_module("report")
    s = io.StringIO()
    with display.Progress(12, "serial (2 threads) epoch 1/1", "lines", every=0.02, stream=s) as pb:
        for k in range(12):
            time.sleep(0.01)
            pb.step(1.0 / (k + 1))
    out = s.getvalue()
    assert out and "\r" not in out
    assert all(ln.startswith("  serial (2 threads) epoch 1/1: step ") for ln in out.splitlines())
    assert display.progress_mode(True) == "off"
    assert display.progress_mode(False, stream=io.StringIO()) == "lines"
    assert report.plural(1, "rank") == "1 rank" and report.plural(2, "rank") == "2 ranks"

    line, caveat = machine_load.load_verdict(0.01, 0.02, 0.0, 0.3, 0.4)
    assert caveat == "" and "2% during" in line
    line, caveat = machine_load.load_verdict(0.01, 0.45, 0.02, 0.3, 1.9)
    assert "CAUTION: speedups unreliable" in caveat and "45%" in caveat and "~10x" in caveat
    assert machine_load.load_verdict(None, None, None, None, None)[1] == ""
    for load in (machine_load.OtherLoad(), machine_load.MachineLoad()):
        share = load.share()
        assert share is None or 0.0 <= share <= 1.0


def test_result_line_says_when_one_thread_beat_all_cores():
    """The ``RESULT:`` line points to the one-core figure when plain PyTensor ran faster on
    one thread than on all cores (small steps: its threads cost more than they gave), and
    says nothing of it otherwise."""
    report = _demo_module("report")
    slow_threads = report.result(0.97, 0.031, 0.020, 0.013, 2, 2, "", "numba", 128)
    assert "2.38x over PyTensor on all cores, 1.54x over one core" in slow_threads
    assert "faster on one thread than on 2" in slow_threads and "one to read" in slow_threads
    fast_threads = report.result(0.97, 0.017, 0.020, 0.013, 2, 2, "", "numba", 128)
    assert "faster on one thread" not in fast_threads
    assert "faster on one thread" not in report.result(0.97, 0.031, 0.020, 0.013, 1, 2, "", "numba", 128)
