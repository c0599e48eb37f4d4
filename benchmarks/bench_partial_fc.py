"""Partial FC against replicated data parallelism: per-rank memory and step time.

The model is ``demos/partial_fc.py``'s (``tanh`` hidden layer, linear embedding, softmax
classifier over C classes, plain SGD), float32, on random data shaped like the 8x8 digits
with random labels among the C classes.  Two ways to train it over n ranks:

* replicated: every rank holds the whole classifier (C x (E+1)), computes the logits of its
  own rows over all classes, and the gradients of every parameter, the classifier's
  included, are summed with an in-graph ``ops.all_reduce`` before every rank applies
  the same SGD step to its copy;
* partial FC: rank r holds only classes ``[C*r//n, C*(r+1)//n)``; the batch's features are
  all-gathered, the softmax normaliser goes through ``ops.all_reduce`` (max, sum), and
  each rank updates its own slice; only the small network's gradients are all-reduced.

Each case runs in a fresh subprocess (its own ranks): after two warm-up steps the peak
resident memory of every rank is reset (``/proc/PID/clear_refs``), then ``--steps`` steps
are timed (median) and every rank's peak resident memory (``VmHWM``: private pages plus
the shared-memory buffers it touched) is read.  The classifier's parameter bytes per rank
are exact.  One rank (the whole model in one process) is the reference.

Prints a table and writes ``benchmarks/results/partial_fc.json`` and ``partial_fc.png``.

    .venv/bin/python benchmarks/bench_partial_fc.py [--classes 10000,100000,500000] [--n 2]
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from common import RESULTS, pyplot, write_results

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# the demos' folder: the model is the partial FC demo's (demos/partial_fc.py)
sys.path.insert(0, os.path.join(ROOT, "demos"))

N_IN, HIDDEN, N_ROWS = 64, 64, 4096


def _status(pid):
    """``{field: kB}`` of /proc/PID/status (VmRSS, VmHWM)."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM"):
                out[k] = int(v.split()[0])
    return out


def _reset_peak(pid):
    with open(f"/proc/{pid}/clear_refs", "w") as fh:
        fh.write("5")


def build_replicated(p, dtype):
    """Data parallelism with the whole classifier on every rank."""
    import pytensor
    import pytensor.tensor as pt
    from pytensor.gradient import disconnected_grad

    import synkhronos as synk
    from partial_fc import features
    from synkhronos import ops
    x, y = pt.matrix("x", dtype=dtype), pt.ivector("y")
    logits = features(x, p) @ p["Wt"].T + p["bc"]          # (own rows, all classes)
    m = disconnected_grad(pt.max(logits, axis=1))
    loss = pt.log(pt.exp(logits - m[:, None]).sum(axis=1)) + m - logits[pt.arange(y.shape[0]), y]
    rows = ops.all_reduce(pt.cast(y.shape[0], dtype), "sum")  # the whole batch
    names = list(p)
    grads = pytensor.grad(pt.sum(loss) / rows, [p[k] for k in names])
    step = pt.constant(0.1, dtype=dtype)
    updates = [(p[k], p[k] - step * ops.all_reduce(g, "sum")) for k, g in zip(names, grads)]
    return synk.function([x, y], (pt.sum(loss) / rows, "sum"), updates=updates)


def one(mode, n_classes, n, embed, batch, steps, seed=0):
    """One case in this process: returns its measurements."""
    import pytensor

    import synkhronos as synk
    from partial_fc import build_synk
    dtype = "float32"
    rng = np.random.default_rng(seed)
    X = rng.random((N_ROWS, N_IN), dtype=np.float32)
    Y = rng.integers(0, n_classes, N_ROWS).astype(np.int32)
    lim = np.sqrt(6.0 / (N_IN + HIDDEN))
    small = {"W0": rng.uniform(-lim, lim, (N_IN, HIDDEN)).astype(dtype), "b0": np.zeros(HIDDEN, dtype),
             "W1": rng.uniform(-lim, lim, (HIDDEN, embed)).astype(dtype)}
    bounds = [n_classes * r // n for r in range(n + 1)] if mode == "partial" else [0] + [n_classes] * n

    def shard(r):        # the classifier rows rank r holds, made one rank at a time
        g = np.random.default_rng(seed + 1 + r)
        rows = bounds[r + 1] - bounds[r]
        return (g.uniform(-0.05, 0.05, (rows, embed)).astype(dtype), np.zeros(rows, dtype))

    synk.fork(n_parallel=n)
    try:
        info = synk.session_info()
        pids = {r.rank: r.pid for r in info.ranks}
        Wt0, bc0 = shard(0)
        params = dict(small, Wt=Wt0, bc=bc0)
        if mode == "partial":
            p, train, _ = build_synk(params, 0.1, dtype)
        else:
            p = {k: pytensor.shared(v, name=k) for k, v in params.items()}
            train = build_replicated(p, dtype)
        synk.distribute()
        for r in range(1, n if mode == "partial" else 1):    # replicated: distribute copied it
            Wt, bc = shard(r)
            synk.set_value(r, [p["Wt"], p["bc"]], [Wt, bc])
            del Wt, bc
        Xd, Yd = synk.data(X), synk.data(Y)
        idxs = [rng.permutation(N_ROWS)[:batch] for _ in range(steps + 2)]
        for idx in idxs[:2]:
            train(Xd, Yd, batch=idx)
        for pid in pids.values():
            _reset_peak(pid)
        ts = []
        for idx in idxs[2:]:
            t0 = time.perf_counter()
            train(Xd, Yd, batch=idx)
            ts.append(time.perf_counter() - t0)
        mem = {r: _status(pid) for r, pid in pids.items()}
        per_rank = [int(s[0]) for s in synk.get_shapes(p["Wt"])]
    finally:
        synk.close()
    item = np.dtype(dtype).itemsize
    return {"mode": mode, "classes": n_classes, "n": n, "embed": embed, "batch": batch,
            "step_ms": 1e3 * float(np.median(ts)), "step_ms_all": [1e3 * t for t in ts],
            "classes_per_rank": per_rank,
            "classifier_mb_per_rank": max(per_rank) * (embed + 1) * item / 2**20,
            "peak_rss_mb": {r: m["VmHWM"] / 1024 for r, m in mem.items()},
            "rss_mb": {r: m["VmRSS"] / 1024 for r, m in mem.items()}}


def run_case(mode, n_classes, n, args):
    cmd = [sys.executable, os.path.abspath(__file__), "--one", mode, "--classes", str(n_classes), "--n", str(n),
           "--embed", str(args.embed), "--batch", str(args.batch), "--steps", str(args.steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"case {mode} C={n_classes} n={n} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("CASE ")][-1]
    return json.loads(line[5:])


def table(results):
    head = (f"{'classes':>8} {'how':<22} {'classes/rank':>13} {'classifier MB/rank':>19} "
            f"{'peak RSS MB/rank':>17} {'step ms':>9}")
    lines = [head, "-" * len(head)]
    for r in results:
        how = "one rank (whole model)" if r["n"] == 1 else f"{r['mode']} x{r['n']}"
        peak = max(r["peak_rss_mb"].values())
        lines.append(f"{r['classes']:>8} {how:<22} {max(r['classes_per_rank']):>13} "
                     f"{r['classifier_mb_per_rank']:>19.1f} {peak:>17.0f} {r['step_ms']:>9.1f}")
    return "\n".join(lines)


def plot(results, path):
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    series = {}
    for r in results:
        label = "one rank (whole model)" if r["n"] == 1 else f"{r['mode']}, {r['n']} ranks"
        series.setdefault(label, []).append(r)
    for label, rs in series.items():
        rs = sorted(rs, key=lambda r: r["classes"])
        cs = [r["classes"] for r in rs]
        axes[0].plot(cs, [max(r["peak_rss_mb"].values()) for r in rs], "o-", label=label)
        axes[1].plot(cs, [r["step_ms"] for r in rs], "o-", label=label)
    axes[0].set_ylabel("peak resident memory per rank (MB)")
    axes[1].set_ylabel("time per training step (ms, median)")
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("classes")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    r0 = results[0]
    fig.suptitle(f"partial FC vs replicated data parallelism (embedding {r0['embed']}, batch {r0['batch']}, "
                 "float32, CPU ranks)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--classes", default="10000,100000,500000", help="class counts (default: %(default)s)")
    ap.add_argument("--n", type=int, default=2, help="ranks (default: %(default)s)")
    ap.add_argument("--embed", type=int, default=64, help="embedding size (default: %(default)s)")
    ap.add_argument("--batch", type=int, default=64, help="rows per step, all ranks (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps (default: %(default)s)")
    ap.add_argument("--no-single", action="store_true", help="skip the one-rank reference")
    ap.add_argument("--one", choices=["partial", "replicated"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    classes = [int(c) for c in args.classes.split(",")]
    if args.one:
        res = one(args.one, classes[0], args.n, args.embed, args.batch, args.steps)
        print("CASE " + json.dumps(res), flush=True)
        return
    results = []
    for c in classes:
        cases = [("replicated", args.n), ("partial", args.n)] + ([] if args.no_single else [("replicated", 1)])
        for mode, n in cases:
            print(f"classes {c}: {mode if n > 1 else 'one rank'} ...", flush=True)
            results.append(run_case(mode, c, n, args))
    print()
    print(table(results))
    write_results(results, "partial_fc.json")
    plot(results, os.path.join(RESULTS, "partial_fc.png"))


if __name__ == "__main__":
    main()
