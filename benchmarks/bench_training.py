"""Training benchmarks for synkhronos on CPU workers (issue 5): the demos' MLP and CNN.

1. Throughput: samples per second of a full data-parallel training step (gradient,
   ``all_reduce`` of the flat gradient, Adam update; ``synkhronos.extensions.train``) at
   n = 1 and n = 2 ranks, with the training set in a ``synk.Data`` selected by shuffled
   index arrays (``batch=idx``), against the same step in one plain PyTensor process through
   the same compiled graphs (``step.serial``) with all cores' BLAS threads and with one.
   Each n runs in turn in this process (``synk.fork(n)`` ... ``synk.close()``); the serial
   baselines run in the n=2 session while its worker sleeps (as in the demos), taking
   turns with the data-parallel steps so that a change of load affects all alike.
2. Time to the first step: building the graphs, compiling and making the first training
   step, in a fresh subprocess per case: plain PyTensor (``pytensor.function`` for the
   gradient and the update, then one step) against synkhronos at n=2
   (``make_train_function`` + ``distribute()`` + one step: the master JIT-compiles, the
   workers load the result from the on-disk cache).  "Cold" gives each subprocess an empty
   PyTensor/numba cache (``PYTENSOR_FLAGS=base_compiledir=<new tmpdir>``); "warm" re-runs
   it with the cache the cold run filled.

The models are those of ``demos/mnist_mlp.py`` (64-1024-1024-10, relu) and
``demos/mnist_cnn.py`` (8x8 digits, conv3x3(16)-pool-conv3x3(32)-pool-dense(128)-10, from
pytensor-ml layers), on data shaped like the 8x8 digits (random values: throughput does not
depend on them).  Prints tables and writes ``benchmarks/results/training.json`` and
``benchmarks/results/training.png``.

3. With ``--torch``: the contenders many users would pick instead, side by side in one
   run: an MLP 784-512-512-10 and a tiny MLP 16-16-2 (float32, relu, softmax
   cross-entropy, the same update rule: Adam, or SGD with ``--rule sgd``) at batches
   64, 256 and 1024 (``--torch-batches``): synkhronos at n=2 (one round trip per step)
   against plain PyTensor in one process (all cores' BLAS threads, and one) and PyTorch in
   one process (``torch.set_num_threads``: all cores, and one) and with
   DistributedDataParallel over gloo (2 processes x 1 thread, loopback).  PyTorch runs
   under its own interpreter (``benchmarks/.torch-venv``, made on first use, see
   ``--torch-python``) as a subprocess, ``benchmarks/_torch_train.py``, that times its
   steps itself; its runs take turns with synkhronos' and PyTensor's within every
   repetition, as above.  Same models, batches, dtype, data shape, steps per timed run
   and repetitions for all; warm-up excluded; medians.  Writes
   ``benchmarks/results/training_torch.json`` and ``training_torch.png``.

    .venv/bin/python benchmarks/bench_training.py [--quick] [--skip-startup] [--batches 128,512]
    .venv/bin/python benchmarks/bench_training.py --torch [--torch-only] [--quick]
"""
import argparse
import contextlib
import glob
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from common import RESULTS, pyplot, write_results
from models import MODELS, N_ROWS, build, model_data

from synkhronos import machine_load

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

RULES = {"adam": 1e-3, "sgd": 0.01}                  # update rule -> learning rate (both sides)

TORCH_VENV = os.path.join(HERE, ".torch-venv")
TORCH_REQ = "torch==2.13.0"                           # here: a CPU wheel on local disk
TORCH_HELPER = os.path.join(HERE, "_torch_train.py")
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS", "NUMBA_NUM_THREADS")


WARM_S = 0.15      # untimed steps before each timed run (see ``timed``)


def timed(fn, idxs, limit=contextlib.nullcontext):
    """A runner: ``run()`` makes one step per index array of ``idxs`` (under ``limit()``,
    e.g. a BLAS thread limit) and returns the time per step.  Steps for ``WARM_S`` come
    first, untimed: the previous runner's threads may still spin (OpenBLAS keeps its threads
    busy ~0.1 s after a 2-thread call, stealing a core from whoever runs next; measured here:
    an n=2 step 5.5 ms instead of 3.0 ms for the first 0.1 s), and threads and workers that
    slept meanwhile wake up.  Every contender gets the same (``_torch_train.py`` too)."""
    def run():
        with limit():
            end, k = time.perf_counter() + WARM_S, 0
            while True:
                fn(idxs[k % len(idxs)])
                k += 1
                if time.perf_counter() >= end:
                    break
            t0 = time.perf_counter()
            for idx in idxs:
                fn(idx)
            return (time.perf_counter() - t0) / len(idxs)
    return run


def per_step(runners, reps):
    """Median over ``reps`` repetitions of each runner's time per step.  The runners take
    turns within each repetition, starting one further each time (a change of load on a
    noisy machine then affects all of them alike, and none is always first).  (A pause
    between runs, to let an OpenMP runtime's spinning threads settle, made every
    two-process contender slower on this virtual machine, synkhronos and DDP alike: the
    runs follow each other at once.)"""
    ts = [[] for _ in runners]
    for r in range(reps):
        for k in range(len(runners)):
            i = (k + r) % len(runners)
            ts[i].append(runners[i]())
    return [float(np.median(t)) for t in ts]


def session(n, models, batches, reps, n_steps, serial, cores, progress):
    """Throughputs (samples/s) at ``n`` ranks, plus the serial baselines if ``serial``
    (measured in the same session while the workers sleep, as the demos do)."""
    import pytensor
    pytensor.config.floatX = "float32"
    import pytensor.tensor as pt
    from threadpoolctl import threadpool_limits

    import synkhronos as synk
    from synkhronos.extensions import train, updates

    rng = np.random.default_rng(0)
    out = {}
    synk.fork(n)
    try:
        steps = {}
        for model in models:
            x = pt.matrix("x", dtype="float32")
            y, loss, params = build(model, x)
            steps[model] = train.make_train_function(loss, params, [x, y], updates.adam,
                                                     learning_rate=1e-3, name=model)
        synk.distribute()
        for model in models:
            step = steps[model]
            X, Y = model_data(model, rng)
            Xd, Yd = synk.data(X), synk.data(Y)
            for B in batches:
                idxs = [rng.permutation(N_ROWS)[:B] for _ in range(n_steps)]
                runners = [timed(lambda idx: step(Xd, Yd, batch=idx), idxs)]
                labels = [f"synk n={n}"]
                if serial:
                    def ser(idx, X=X, Y=Y, step=step):
                        return step.serial(X[idx], Y[idx])
                    runners += [timed(ser, idxs, lambda: threadpool_limits(limits=cores)),
                                timed(ser, idxs, lambda: threadpool_limits(limits=1))]
                    labels += [f"PyTensor {cores} threads", "PyTensor 1 thread"]
                for run in runners:                     # warm-up (JIT or cache load)
                    run()
                for label, t in zip(labels, per_step(runners, reps)):
                    out[(model, B, label)] = B / t
                    progress.update()
    finally:
        synk.close()
    return out


# ------------------------------------------------------------------------------------------
# The PyTorch contender (--torch)


def _has_torch(python):
    try:
        r = subprocess.run([python, "-c", "import warnings; warnings.simplefilter('ignore'); "
                            "import torch; print(torch.__version__)"],
                           capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _base_python():
    """An interpreter to make the PyTorch venv with: python3.11 on PATH, else pyenv's newest
    3.11 (the Python version of the local PyTorch CPU wheel)."""
    found = shutil.which("python3.11")
    if found:
        return found
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    cands = sorted(glob.glob(os.path.join(root, "versions", "3.11*", "bin", "python")),
                   key=lambda p: [int(t) if t.isdigit() else 0 for t in p.split("/")[-3].split(".")])
    return cands[-1] if cands else None


def torch_python(args):
    """The interpreter that runs ``_torch_train.py``: ``--torch-python``, else
    ``benchmarks/.torch-venv`` (made now if it has no torch: ``python3.11 -m venv`` and
    ``pip install torch==2.13.0``)."""
    if args.torch_python:
        if not _has_torch(args.torch_python):
            sys.exit(f"--torch-python {args.torch_python}: cannot import torch there")
        return args.torch_python
    py = os.path.join(TORCH_VENV, "bin", "python")
    if os.path.exists(py) and _has_torch(py):
        return py
    base = args.torch_base_python or _base_python()
    if not base:
        sys.exit("--torch: no Python 3.11 found to make benchmarks/.torch-venv; give one with "
                 "--torch-base-python, or an interpreter that has torch with --torch-python")
    print(f"making the PyTorch venv: {base} -m venv {os.path.relpath(TORCH_VENV, ROOT)} && "
          f"{os.path.relpath(py, ROOT)} -m pip install {args.torch_req}", file=sys.stderr, flush=True)
    if not os.path.exists(py):
        subprocess.run([base, "-m", "venv", TORCH_VENV], check=True)
    subprocess.run([py, "-m", "pip", "install", args.torch_req], check=True)
    if not _has_torch(py):
        sys.exit(f"--torch: torch does not import in {py} after the install")
    return py


class TorchContender:
    """``_torch_train.py serve`` in a subprocess: ``run(who, **req)`` makes it time one run of
    steps (``who``: "single" or "ddp") and returns the time per step it measured."""

    def __init__(self, python, threads, world):
        env = {k: v for k, v in os.environ.items()
               if k not in THREAD_VARS and k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen([python, TORCH_HELPER, "serve", "--threads", str(threads),
                                      "--world", str(world)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=HERE)
        self.info = self._reply()

    def _reply(self):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the PyTorch helper ended (exit code {self.proc.poll()}); "
                               f"its messages are above")
        r = json.loads(line)
        if "error" in r:
            raise RuntimeError(f"the PyTorch helper failed: {r['error']}")
        return r

    def run(self, who, **req):
        self.proc.stdin.write(json.dumps(dict(cmd="run", who=who, **req)) + "\n")
        self.proc.stdin.flush()
        r = self._reply()
        self.last = r
        return r["t"]

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"cmd": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(30)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def contender_labels(cores, with_torch):
    labels = ["synk n=2", "synk n=2 sharded", f"PyTensor {cores} threads", "PyTensor 1 thread"]
    if with_torch:
        labels += [f"PyTorch {cores} threads", "PyTorch 1 thread", "PyTorch DDP 2x1"]
    return labels


def contenders(models, batches, reps, n_steps, cores, rule, tc, progress):
    """Time per step of every contender at every (model, batch), in one n=2 session: synk
    n=2 (the plain step, and with ``shard_updates=True``), PyTensor in the master (all
    cores' BLAS threads, and one), and through ``tc`` (a ``TorchContender`` or None) PyTorch
    in one process (all cores' threads, and one) and DDP 2 x 1 thread.  All take turns
    within each repetition."""
    import pytensor
    pytensor.config.floatX = "float32"
    import pytensor.tensor as pt
    from threadpoolctl import threadpool_limits

    import synkhronos as synk
    from synkhronos.extensions import train, updates

    lr = RULES[rule]
    labels = contender_labels(cores, tc is not None)
    rng = np.random.default_rng(0)
    out = {}
    synk.fork(2)
    try:
        steps, sharded = {}, {}
        for model in models:
            x = pt.matrix("x", dtype="float32")
            y, loss, params = build(model, x)
            steps[model] = train.make_train_function(loss, params, [x, y], getattr(updates, rule),
                                                     learning_rate=lr, name=model)
            y, loss, params = build(model, x)
            sharded[model] = train.make_train_function(loss, params, [x, y], getattr(updates, rule),
                                                       learning_rate=lr, name=f"{model}_sharded",
                                                       shard_updates=True)
        synk.distribute()
        for model in models:
            step = steps[model]
            X, Y = model_data(model, rng)
            Xd, Yd = synk.data(X), synk.data(Y)
            k = n_steps * MODELS[model].get("steps_factor", 1)

            def ser(idx, X=X, Y=Y, step=step):
                return step.serial(X[idx], Y[idx])
            for B in batches:
                idxs = [rng.permutation(N_ROWS)[:B] for _ in range(k)]
                runners = [timed(lambda idx, step=step, Xd=Xd, Yd=Yd: step(Xd, Yd, batch=idx), idxs),
                           timed(lambda idx, step=sharded[model], Xd=Xd, Yd=Yd: step(Xd, Yd, batch=idx),
                                 idxs),
                           timed(ser, idxs, lambda: threadpool_limits(limits=cores)),
                           timed(ser, idxs, lambda: threadpool_limits(limits=1))]
                if tc is not None:
                    req = dict(sizes=list(MODELS[model]["sizes"]), batch=B, steps=k, rule=rule,
                               lr=lr, n_rows=N_ROWS, seed=0)
                    runners += [lambda req=req: tc.run("single", threads=cores, **req),
                                lambda req=req: tc.run("single", threads=1, **req),
                                lambda req=req: tc.run("ddp", **req)]
                for run in runners:                     # warm-up (JIT, cache load, first touch)
                    run()
                for label, t in zip(labels, per_step(runners, reps)):
                    out[(model, B, label)] = t
                progress.update()
    finally:
        synk.close()
    return out


def report_contenders(times, models, batches, cores, rule, reps, n_steps, info, busy, loads):
    labels = contender_labels(cores, info is not None)
    both = [c for c in labels if c.endswith(f"{cores} threads")]      # single process, all cores
    singles = [c for c in labels if "threads" in c or c.endswith("1 thread")]
    who = "synkhronos n=2 (plain and sharded updates), PyTensor" + (", PyTorch" if info else "")
    print(f"\nContenders: {who}; {rule} step incl. batch gather, float32; {cores} cores; "
          f"median of {reps} runs; load average {loads[0]} -> {loads[1]}")
    print("  CPU kept busy by other programs: "
          + ", ".join(f"{k}: {machine_load.percent(b)}" for k, b in busy.items()))
    if info:
        print(f"  PyTorch {info['torch']} (Python {info['python']}, CPU build), optimizer "
              f"fused={info.get('impl') == 'fused'}; DDP: gloo over loopback, 2 processes x 1 thread")
    short = {f"PyTensor {cores} threads": f"PyTensor {cores}t", "PyTensor 1 thread": "PyTensor 1t",
             f"PyTorch {cores} threads": f"PyTorch {cores}t", "PyTorch 1 thread": "PyTorch 1t",
             "PyTorch DDP 2x1": "DDP 2x1", "synk n=2": "synk n=2", "synk n=2 sharded": "synk shard"}
    rows = []
    for unit, scale, title in (("samples/s", None, "throughput, samples/s"),
                               ("us", 1e6, "time per step, µs")):
        print(f"\n  {title}")
        head = f"  {'model':6s} {'batch':>5s} " + " ".join(f"{short[c]:>12s}" for c in labels)
        if scale is None:
            head += f"  {'synk/best ' + str(cores) + '-core single':>24s}" + "  best single (any threads)"
        print(head)
        for m in models:
            for B in batches:
                t = {c: times[(m, B, c)] for c in labels}
                vals = [B / t[c] if scale is None else t[c] * scale for c in labels]
                line = f"  {m:6s} {B:5d} " + " ".join(
                    f"{v:12.0f}" if v >= 100 else f"{v:12.1f}" for v in vals)
                if scale is None:
                    best = min(both, key=lambda c: t[c])
                    best_any = min(singles, key=lambda c: t[c])
                    r, r_any = t[best] / t["synk n=2"], t[best_any] / t["synk n=2"]
                    line += f"  {r:8.2f}x ({short[best]:>11s})  {r_any:.2f}x ({short[best_any]})"
                    rows.append(dict(model=m, desc=MODELS[m]["desc"], batch=B,
                                     steps_per_run=n_steps * MODELS[m].get("steps_factor", 1),
                                     s_per_step=t, samples_per_s={c: B / t[c] for c in labels},
                                     best_all_cores_single=best, synk_vs_best_all_cores_single=r,
                                     best_single_any_threads=best_any, synk_vs_best_single=r_any,
                                     synk_vs={c: t[c] / t["synk n=2"] for c in labels
                                              if c != "synk n=2"}))
                print(line)
    return rows


def write_contenders(rows, models, batches, cores, rule, reps, n_steps, info, busy, loads):
    labels = contender_labels(cores, info is not None)
    res = dict(machine=dict(cores=cores, cpu=cpu_model(), platform=platform.platform(),
                            note="shared machine: other programs ran; see busy/load"),
               load_before=loads[0], load_after=loads[1], busy=busy, rule=rule,
               learning_rate=RULES[rule], reps=reps, dtype="float32", rows_in_training_set=N_ROWS,
               versions=versions(), torch=info, contenders=labels, results=rows)
    write_results(res, "training_torch.json")
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    colors = {"synk n=2": "C0", "synk n=2 sharded": "C2", f"PyTensor {cores} threads": "silver",
              "PyTensor 1 thread": "gray",
              f"PyTorch {cores} threads": "C3", "PyTorch 1 thread": "lightcoral",
              "PyTorch DDP 2x1": "C1"}
    by = {(r["model"], r["batch"]): r for r in rows}
    width = 0.8 / len(labels)
    for ax, m in zip(axes[0], models):
        as_time = MODELS[m].get("plot") == "time"
        xs = np.arange(len(batches))
        for i, c in enumerate(labels):
            vals = [by[(m, B)]["s_per_step"][c] * 1e6 if as_time else by[(m, B)]["samples_per_s"][c]
                    for B in batches]
            ax.bar(xs + (i - (len(labels) - 1) / 2) * width, vals, width, label=c,
                   color=colors.get(c))
        for j, B in enumerate(batches):
            r = by[(m, B)]
            y = (r["s_per_step"]["synk n=2"] * 1e6 if as_time else r["samples_per_s"]["synk n=2"])
            ax.annotate(f"{r['synk_vs_best_all_cores_single']:.2f}x",
                        (xs[j] - (len(labels) - 1) / 2 * width, y), textcoords="offset points",
                        xytext=(0, 3), ha="center", fontsize=8, color="C0")
        ax.set_xticks(xs, [f"batch {B}" for B in batches])
        if as_time:
            ax.set_yscale("log")
            ax.set_ylabel("µs per step (lower is better)")
        else:
            ax.set_ylabel("samples / s (higher is better)")
        ax.set_title(f"{MODELS[m]['desc']}, {rule}", fontsize=10)
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    fig.suptitle(f"training step, {cores}-core CPU (shared, noisy); label: synk n=2 / best "
                 f"{cores}-core single process", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(os.path.join(RESULTS, "training_torch.png"), dpi=110)
    print(f"\nsaved {os.path.join(RESULTS, 'training_torch.png')} and training_torch.json")


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for ln in f:
                if ln.startswith("model name"):
                    return ln.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def versions():
    import importlib.metadata as md
    v = {"python": platform.python_version()}
    for p in ("pytensor", "numpy", "numba", "synkhronos"):
        try:
            v[p] = md.version(p)
        except md.PackageNotFoundError:
            pass
    return v


def wait_quiet(seconds, progress):
    """Wait up to ``seconds`` for other programs to use under 10% of the machine."""
    end = time.monotonic() + seconds
    b = machine_load.machine_busy(1.0)
    while b is not None and b >= machine_load.BUSY and time.monotonic() < end:
        progress.write(f"(other programs use {machine_load.percent(b)} of the CPU: waiting)")
        time.sleep(4.0)
        b = machine_load.machine_busy(1.0)
    return b


STARTUP_CHILD = r"""
import json, sys, time
sys.path.insert(0, {here!r})
import numpy as np
import pytensor
pytensor.config.floatX = "float32"
import pytensor.tensor as pt
from models import build, N_IN
from synkhronos.extensions import updates
model, mode, B = sys.argv[1], sys.argv[2], int(sys.argv[3])
X = np.random.default_rng(1).random((B, N_IN), dtype=np.float32)
Y = np.random.default_rng(2).integers(0, 10, B).astype(np.int32)
r = {{}}
if mode == "serial":
    t0 = time.perf_counter()
    x = pt.matrix("x", dtype="float32")
    y, loss, params = build(model, x)
    g_upd, p_upd, _ = updates.adam(loss, params, learning_rate=1e-3)
    f_grad = pytensor.function([x, y], loss, updates=g_upd)
    f_upd = pytensor.function([], updates=p_upd)
    t1 = time.perf_counter()
    f_grad(X, Y); f_upd()
    t2 = time.perf_counter()
    r = dict(build_compile=t1 - t0, first_step=t2 - t1, total=t2 - t0)
else:
    import synkhronos as synk
    from synkhronos.extensions import train
    synk.fork(2)
    try:
        t0 = time.perf_counter()
        x = pt.matrix("x", dtype="float32")
        y, loss, params = build(model, x)
        step = train.make_train_function(loss, params, [x, y], updates.adam, learning_rate=1e-3)
        t1 = time.perf_counter()
        synk.distribute()
        t2 = time.perf_counter()
        step(synk.data(X), synk.data(Y))
        t3 = time.perf_counter()
        r = dict(build_compile=t1 - t0, distribute=t2 - t1, first_step=t3 - t2, total=t3 - t0)
    finally:
        synk.close()
print("STARTUP " + json.dumps(r))
"""


def startup(models, batch, progress):
    code = STARTUP_CHILD.format(here=HERE)
    out = {}
    with tempfile.TemporaryDirectory(prefix="synk_bench_train_cache_") as tmp:
        for model in models:
            for mode in ("serial", "synk"):
                env = dict(os.environ, PYTHONUNBUFFERED="1")
                env["PYTENSOR_FLAGS"] = f"base_compiledir={os.path.join(tmp, model + '_' + mode)}"
                for cache in ("cold", "warm"):
                    r = subprocess.run([sys.executable, "-c", code, model, mode, str(batch)], env=env,
                                       capture_output=True, text=True, timeout=1800, cwd=ROOT)
                    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("STARTUP ")]
                    if r.returncode != 0 or not lines:
                        raise RuntimeError(f"startup child {model} {mode} {cache} failed:\n"
                                           f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
                    out[(model, mode, cache)] = json.loads(lines[-1][len("STARTUP "):])
                    progress.update()
    return out


def load_note():
    """The 1-minute load average as ``/proc/loadavg`` writes it, or "?"."""
    la = machine_load.load_average()
    return "?" if la is None else f"{la:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and steps")
    ap.add_argument("--batches", default="128,512",
                    help="batch sizes (rows per step over all ranks), comma-separated")
    ap.add_argument("--models", default="mlp,cnn", help="comma-separated: mlp, cnn")
    ap.add_argument("--skip-startup", action="store_true", help="no time-to-first-step runs")
    g = ap.add_argument_group("comparison with PyTorch")
    g.add_argument("--torch", action="store_true",
                   help="add the contenders' comparison: synk n=2, PyTensor and PyTorch (one "
                        "process; DDP 2x1 over gloo) on --torch-models at --torch-batches")
    g.add_argument("--torch-only", action="store_true",
                   help="only the contenders' comparison (implies --torch)")
    g.add_argument("--no-torch-contender", action="store_true",
                   help="the contenders' comparison without PyTorch, synk and PyTensor only "
                        "(implies --torch)")
    g.add_argument("--torch-models", default="mlp784,mlp,tiny",
                   help="comma-separated: mlp784 (784-512-512-10), mlp (the demo's 64-1024-1024-10), "
                        "tiny (16-16-2) "
                        "(default: %(default)s)")
    g.add_argument("--torch-batches", default="64,256,1024",
                   help="batch sizes of the comparison (default: %(default)s)")
    g.add_argument("--rule", choices=sorted(RULES), default="adam",
                   help="update rule of the comparison, the same on both sides (default: %(default)s)")
    g.add_argument("--torch-python", default=None, metavar="PY",
                   help="an interpreter that has torch (default: benchmarks/.torch-venv, made "
                        "on first use)")
    g.add_argument("--torch-base-python", default=None, metavar="PY",
                   help="the interpreter that makes benchmarks/.torch-venv (default: python3.11 "
                        "on PATH, else pyenv's 3.11)")
    g.add_argument("--torch-req", default=TORCH_REQ,
                   help="what pip installs in benchmarks/.torch-venv (default: %(default)s, a "
                        "CPU build on this machine)")
    g.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                   help="before timing, wait up to S seconds for other programs to use under "
                        "10%% of the CPU (default: do not wait)")
    args = ap.parse_args()
    if args.torch_only or args.no_torch_contender:
        args.torch = True
    from tqdm import tqdm
    cores = len(os.sched_getaffinity(0))
    batches = [int(b) for b in args.batches.split(",")]
    models = [m for m in args.models.split(",") if m]
    tmodels = [m for m in args.torch_models.split(",") if m]
    tbatches = [int(b) for b in args.torch_batches.split(",")]
    for m in tmodels:
        if "sizes" not in MODELS.get(m, {}):
            ap.error(f"--torch-models: {m!r} is not an MLP of MODELS "
                     f"({', '.join(k for k, v in MODELS.items() if 'sizes' in v)})")
    reps, n_steps = (3, 10) if args.quick else (9, 20)
    ns = [1, 2]
    demos = not args.torch_only
    tc = None
    if args.torch and not args.no_torch_contender:
        py = torch_python(args)                  # before any session: may install PyTorch
        tc = TorchContender(py, cores, 2)
    try:
        total = 0
        if demos:
            total += len(models) * len(batches) * (len(ns) + 2) + (0 if args.skip_startup else 4 * len(models))
        if args.torch:
            total += len(tmodels) * len(tbatches)
        prog = tqdm(total=total, desc="bench_training", file=sys.stderr)
        if args.torch:
            busy = {}
            if args.wait_quiet > 0:
                wait_quiet(args.wait_quiet, prog)
            loads = [load_note()]
            busy["before"] = machine_load.machine_busy(1.0)
            during = machine_load.OtherLoad()
            times = contenders(tmodels, tbatches, reps, n_steps, cores, args.rule, tc, prog)
            busy["during"] = during.share()
            loads.append(load_note())
            info = None
            if tc is not None:
                info = {k: v for k, v in tc.info.items() if k != "ready"}
                info["impl"] = tc.last.get("impl")
        if demos:
            load0 = load_note()
            thr, dbusy = {}, {}
            for n in ns:
                if args.wait_quiet > 0:
                    wait_quiet(args.wait_quiet, prog)
                dbusy[n] = machine_load.machine_busy(1.0)          # other programs, before the session starts
                thr.update(session(n, models, batches, reps, n_steps, n == ns[-1], cores, prog))
            st = None if args.skip_startup else startup(models, 128, prog)
        prog.close()
    finally:
        if tc is not None:
            tc.close()
    if demos:
        report(thr, st, models, batches, cores, ns, load0, load_note(), dbusy)
    if args.torch:
        rows = report_contenders(times, tmodels, tbatches, cores, args.rule, reps, n_steps, info,
                                 busy, loads)
        write_contenders(rows, tmodels, tbatches, cores, args.rule, reps, n_steps, info, busy, loads)


def report(thr, st, models, batches, cores, ns, load0, load1, busy):
    cols = ["PyTensor 1 thread", f"PyTensor {cores} threads"] + [f"synk n={n}" for n in ns]
    print(f"\nTraining throughput, samples/s (Adam step incl. batch gather; {cores} cores; "
          f"load average {load0} -> {load1})")
    print("  CPU kept busy by other programs just before each session: "
          + ", ".join(f"n={n}: {machine_load.percent(b)}" for n, b in busy.items()))
    head = f"  {'model':5s} {'batch':>5s} " + " ".join(f"{c:>20s}" for c in cols)
    print(head + f" {'synk n=2 / all cores':>21s} {'/ 1 thread':>11s}")
    rows = []
    for m in models:
        for B in batches:
            v = [thr[(m, B, c)] for c in cols]
            ref_all, ref_1, s2 = thr[(m, B, cols[1])], thr[(m, B, cols[0])], thr[(m, B, "synk n=2")]
            print(f"  {m:5s} {B:5d} " + " ".join(f"{x:20.0f}" for x in v)
                  + f" {s2 / ref_all:20.2f}x {s2 / ref_1:10.2f}x")
            rows.append(dict(model=m, batch=B, **{c: thr[(m, B, c)] for c in cols},
                             speedup_vs_allcores=s2 / ref_all, speedup_vs_1thread=s2 / ref_1))
    res = dict(cores=cores, load_before=load0, load_after=load1,
               busy_before_session={str(n): b for n, b in busy.items()}, throughput=rows)
    if st is not None:
        print("\nTime to the first training step (s): build + compile + first step (JIT or cache load)")
        print(f"  {'model':5s} {'':34s} {'cold cache':>11s} {'warm cache':>11s}   cold: first step")
        srows = []
        for m in models:
            for mode, label in (("serial", "plain PyTensor (1 process)"),
                                ("synk", "synk n=2 (function+distribute+step)")):
                c, w = st[(m, mode, "cold")], st[(m, mode, "warm")]
                print(f"  {m:5s} {label:34s} {c['total']:11.1f} {w['total']:11.1f}   {c['first_step']:.1f}")
                srows.append(dict(model=m, mode=mode, cold=c, warm=w))
        res["startup"] = srows
    write_results(res, "training.json")
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2 if st is not None else 1, figsize=(12 if st is not None else 7, 4.2),
                             squeeze=False)
    ax = axes[0][0]
    groups = [(m, B) for m in models for B in batches]
    width = 0.8 / len(cols)
    colors = ["gray", "silver", "C1", "C0"]
    for i, c in enumerate(cols):
        ax.bar(np.arange(len(groups)) + (i - (len(cols) - 1) / 2) * width,
               [thr[(m, B, c)] for m, B in groups], width, label=c, color=colors[i % len(colors)])
    ax.set_xticks(np.arange(len(groups)), [f"{m.upper()}\nbatch {B}" for m, B in groups])
    ax.set_ylabel("samples / s")
    ax.set_title(f"training throughput ({cores} cores)")
    ax.legend(fontsize=8)
    if st is not None:
        ax = axes[0][1]
        labels, cold, warm = [], [], []
        for m in models:
            for mode in ("serial", "synk"):
                labels.append(f"{m.upper()}\n{'PyTensor' if mode == 'serial' else 'synk n=2'}")
                cold.append(st[(m, mode, "cold")]["total"])
                warm.append(st[(m, mode, "warm")]["total"])
        xs = np.arange(len(labels))
        ax.bar(xs - 0.2, cold, 0.4, label="cold cache", color="C3")
        ax.bar(xs + 0.2, warm, 0.4, label="warm cache", color="C2")
        ax.set_xticks(xs, labels)
        ax.set_ylabel("s")
        ax.set_title("build + compile + first step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "training.png"), dpi=110)
    print(f"\nsaved {os.path.join(RESULTS, 'training.png')} and training.json")


if __name__ == "__main__":
    main()
