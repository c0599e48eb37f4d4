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

    .venv/bin/python benchmarks/bench_training.py [--quick] [--skip-startup] [--batches 128,512]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEMOS = os.path.join(ROOT, "demos")
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, DEMOS)

N_IN, N_ROWS = 64, 8192          # 8x8 images, enough rows for any batch here


def build(model, x, seed=0):
    """(loss, params) of one of the demos' models on the float32 input matrix ``x``."""
    import pytensor.tensor as pt
    y = pt.ivector("y")
    if model == "mlp":
        from mnist_mlp import build_mlp
        params, forward = build_mlp(N_IN, 1024, 10, seed)
        logits = forward(x)
    else:
        import layers
        m = layers.cnn(x, 8, 8, channels=(16, 32), hidden=128, seed=seed)
        params, logits = m.params, m.logits
    logp = pt.special.log_softmax(logits, axis=-1)
    return y, pt.mean(-logp[pt.arange(y.shape[0]), y]), params


def per_step(fns, idxs, reps):
    """Median over ``reps`` of the time per step of running each of ``fns`` on every index
    array; the functions take turns within each repetition (a change of load on a noisy
    machine then affects all of them alike)."""
    ts = [[] for _ in fns]
    for _ in range(reps):
        for i, (fn, limit) in enumerate(fns):
            with limit():
                t0 = time.perf_counter()
                for idx in idxs:
                    fn(idx)
                ts[i].append((time.perf_counter() - t0) / len(idxs))
    return [float(np.median(t)) for t in ts]


def session(n, models, batches, reps, n_steps, serial, cores, progress):
    """Throughputs (samples/s) at ``n`` ranks, plus the serial baselines if ``serial``
    (measured in the same session while the workers sleep, as the demos do)."""
    import contextlib

    import pytensor
    pytensor.config.floatX = "float32"
    import pytensor.tensor as pt
    from threadpoolctl import threadpool_limits

    import synkhronos as synk
    from synkhronos.extensions import train, updates

    rng = np.random.default_rng(0)
    X = rng.random((N_ROWS, N_IN), dtype=np.float32)
    Y = rng.integers(0, 10, N_ROWS).astype(np.int32)
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
        Xd, Yd = synk.data(X), synk.data(Y)
        for model in models:
            step = steps[model]
            for B in batches:
                idxs = [rng.permutation(N_ROWS)[:B] for _ in range(n_steps)]
                fns = [(lambda idx: step(Xd, Yd, batch=idx), contextlib.nullcontext)]
                labels = [f"synk n={n}"]
                if serial:
                    def ser(idx):
                        return step.serial(X[idx], Y[idx])
                    fns += [(ser, lambda: threadpool_limits(limits=cores)),
                            (ser, lambda: threadpool_limits(limits=1))]
                    labels += [f"PyTensor {cores} threads", "PyTensor 1 thread"]
                for fn, limit in fns:                   # warm-up (JIT or cache load)
                    with limit():
                        for idx in idxs[:2]:
                            fn(idx)
                for label, t in zip(labels, per_step(fns, idxs, reps)):
                    out[(model, B, label)] = B / t
                    progress.update()
    finally:
        synk.close()
    return out


STARTUP_CHILD = r"""
import json, sys, time
sys.path.insert(0, {here!r}); sys.path.insert(0, {demos!r})
import numpy as np
import pytensor
pytensor.config.floatX = "float32"
import pytensor.tensor as pt
from bench_training import build, N_IN
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
    code = STARTUP_CHILD.format(here=HERE, demos=DEMOS)
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
    try:
        with open("/proc/loadavg") as f:
            return f.read().split()[0]
    except OSError:
        return "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and steps")
    ap.add_argument("--batches", default="128,512",
                    help="batch sizes (rows per step over all ranks), comma-separated")
    ap.add_argument("--models", default="mlp,cnn", help="comma-separated: mlp, cnn")
    ap.add_argument("--skip-startup", action="store_true", help="no time-to-first-step runs")
    args = ap.parse_args()
    from tqdm import tqdm
    cores = len(os.sched_getaffinity(0))
    batches = [int(b) for b in args.batches.split(",")]
    models = [m for m in args.models.split(",") if m]
    reps, n_steps = (3, 10) if args.quick else (9, 20)
    ns = [1, 2]
    total = len(models) * len(batches) * (len(ns) + 2) + (0 if args.skip_startup else 4 * len(models))
    prog = tqdm(total=total, desc="bench_training", file=sys.stderr)
    from harness import machine_busy
    load0 = load_note()
    thr, busy = {}, {}
    for n in ns:
        busy[n] = machine_busy(1.0)          # other programs, before the session starts
        thr.update(session(n, models, batches, reps, n_steps, n == ns[-1], cores, prog))
    st = None if args.skip_startup else startup(models, 128, prog)
    prog.close()
    report(thr, st, models, batches, cores, ns, load0, load_note(), busy)


def report(thr, st, models, batches, cores, ns, load0, load1, busy):
    cols = ["PyTensor 1 thread", f"PyTensor {cores} threads"] + [f"synk n={n}" for n in ns]
    print(f"\nTraining throughput, samples/s (Adam step incl. batch gather; {cores} cores; "
          f"load average {load0} -> {load1})")
    print("  CPU kept busy by other programs just before each session: "
          + ", ".join(f"n={n}: {'?' if b is None else f'{100 * b:.0f}%'}" for n, b in busy.items()))
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
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "training.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
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
