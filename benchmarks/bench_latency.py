"""Fixed costs of synkhronos at n=2 (issue 13's goals), optionally against another checkout.

Measured, each in a fresh process per checkout and round (rounds alternate between the
checkouts, so both see the same machine; the table shows each figure's best round):

* added per-call overhead of a trivial function (``synk.Data`` inputs) over the plain
  PyTensor call, goal <= 20 us;
* a training step of a tiny model (16-16-2, SGD, whole batch of 64), goal <= 60 us;
* ``synk.all_reduce`` of 4 KB, goal <= 20 us;
* an in-graph ``synkhronos.ops.all_reduce`` of 4 KB, per op (a call with 8 chained ops
  minus a call with none), goal <= 10 us;
* ``synk.all_reduce`` of 64 MB over one 64 MB ``np.copyto``, goal <= 1.5;
* without a goal: in-graph ``ops.all_gather`` and ``ops.broadcast`` of 4 KB, per op.

Usage: python benchmarks/bench_latency.py [--against PATH] [--rounds 3]
(PATH: the root of another synkhronos checkout, e.g. a ``git worktree`` of an older commit).
Saves benchmarks/results/latency.json and latency.png."""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

from common import RESULTS, call_times, pyplot, write_results

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

GOALS = {"call_added_us": ("added per-call overhead, trivial function", 20, "us"),
         "train_step_us": ("training step, tiny model (16-16-2, SGD)", 60, "us"),
         "all_reduce_4k_us": ("synk.all_reduce, 4 KB", 20, "us"),
         "ingraph_4k_us": ("in-graph ops.all_reduce, 4 KB, per op", 10, "us"),
         "ingraph_gather_4k_us": ("in-graph ops.all_gather, 4 KB, per op", None, "us"),
         "ingraph_bcast_4k_us": ("in-graph ops.broadcast, 4 KB, per op", None, "us"),
         "all_reduce_64m_ratio": ("synk.all_reduce 64 MB / np.copyto 64 MB", 1.5, "x")}


def best(fn, rounds=7, inner=300):
    """The best of ``rounds`` mean times of ``inner`` calls (seconds)."""
    return min(call_times(fn, rounds, inner))


def child(repo):
    """Measure everything with the synkhronos of ``repo``; print one JSON line."""
    sys.path.insert(0, repo)
    import pytensor
    import pytensor.tensor as T
    import synkhronos as synk
    from synkhronos.extensions import train, updates
    repo = os.path.realpath(repo)
    if not os.path.realpath(synk.__file__).startswith(repo + os.sep):
        raise RuntimeError(f"synkhronos was imported from {synk.__file__}, not from {repo}")
    try:
        from synkhronos import ops
        if not os.path.realpath(ops.__file__).startswith(repo + os.sep):
            ops = None                    # (an editable install's finder found this checkout's)
    except ImportError:                   # a checkout from before in-graph collectives
        ops = None
    synk.fork(2)
    rng = np.random.default_rng(1)
    # trivial function
    x, y = T.fmatrix("x"), T.fvector("y")
    z = T.mean(x.dot(y), axis=0)
    f = synk.function([x], bcast_inputs=[y], outputs=z)
    f_plain = pytensor.function([x, y], z)
    # tiny training step
    X = rng.standard_normal((64, 16)).astype("float32")
    Y = rng.integers(0, 2, 64).astype(np.int64)
    xs, ys = T.matrix("xs", dtype="float32"), T.vector("ys", dtype="int64")
    W1 = pytensor.shared((rng.standard_normal((16, 16)) * 0.3).astype("float32"), name="W1")
    W2 = pytensor.shared((rng.standard_normal((16, 2)) * 0.3).astype("float32"), name="W2")
    p = T.special.softmax(T.tanh(xs.dot(W1)).dot(W2), axis=1)
    loss = -T.mean(T.log(p[T.arange(ys.shape[0]), ys]))
    step = train.make_train_function(loss, [W1, W2], [xs, ys], updates.sgd, learning_rate=0.01)
    # collectives
    small = pytensor.shared(np.zeros(1024, "float32"), name="small")
    big = pytensor.shared(np.zeros(16 << 20, "float32"), name="big")
    synk.function([], outputs=[small.sum(), big.sum()])
    chained = {}                          # (verb, ops in the chain) -> function
    if ops is not None:
        v = T.fvector("v")
        verbs = {"all_reduce": lambda h: ops.all_reduce(h, "sum"), "gather": lambda h: ops.all_gather(h)[:1024],
                 "bcast": lambda h: ops.broadcast(h, 0)}
        for verb, op in verbs.items():
            for k in (0, 8):
                h = v
                for _ in range(k):
                    h = op(h) * np.float32(0.5)
                chained[(verb, k)] = synk.function([], outputs=(h.sum(), None), bcast_inputs=[v])
    synk.distribute()
    xt = rng.standard_normal((8, 4)).astype("float32")
    yt = rng.standard_normal(4).astype("float32")
    xd, yd, Xd, Yd = synk.data(xt), synk.data(yt), synk.data(X), synk.data(Y)
    vd = synk.data(np.ones(1024, "float32"))
    for _ in range(50):                   # warm: compiled, plans cached, buffers mapped
        f(xd, yd)
        f_plain(xt, yt)
        step(Xd, Yd)
        synk.all_reduce(small, "sum")
        for g in chained.values():
            g(vd)
    out = {"call_added_us": (best(lambda: f(xd, yd), inner=1000) - best(lambda: f_plain(xt, yt), inner=1000)) * 1e6,
           "train_step_us": best(lambda: step(Xd, Yd)) * 1e6,
           "all_reduce_4k_us": best(lambda: synk.all_reduce(small, "sum"), inner=500) * 1e6,
           **{key: ((best(lambda: chained[(verb, 8)](vd)) - best(lambda: chained[(verb, 0)](vd))) / 8 * 1e6
                    if chained else None)
              for key, verb in (("ingraph_4k_us", "all_reduce"), ("ingraph_gather_4k_us", "gather"),
                                ("ingraph_bcast_4k_us", "bcast"))}}
    synk.all_reduce(big, "sum")
    a = np.ones(16 << 20, "float32")
    b = np.empty_like(a)
    out["all_reduce_64m_ratio"] = (best(lambda: synk.all_reduce(big, "sum"), inner=10)
                                   / best(lambda: np.copyto(b, a), inner=10))
    synk.close()
    print("LATENCY " + json.dumps(out), flush=True)


def measure(repo):
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", repo], capture_output=True,
                       text=True, timeout=900)
    lines = [ln[8:] for ln in p.stdout.splitlines() if ln.startswith("LATENCY ")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"measuring {repo} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", metavar="PATH", help="root of another synkhronos checkout to compare with")
    ap.add_argument("--rounds", type=int, default=3, help="processes per checkout (default: 3)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    repos = {"this checkout": ROOT}
    if args.against:
        repos = {f"against ({os.path.basename(os.path.abspath(args.against))})": os.path.abspath(args.against),
                 **repos}
    runs = {name: [] for name in repos}
    for r in range(args.rounds):
        for name, repo in repos.items():
            print(f"round {r + 1}/{args.rounds}: {name} ...", flush=True)
            runs[name].append(measure(repo))
    table = {name: {k: min((m[k] for m in ms if m.get(k) is not None), default=None) for k in GOALS}
             for name, ms in runs.items()}
    names = list(repos)
    print(f"\n{'what (n=2)':44s} " + " ".join(f"{n[:22]:>22s}" for n in names) + f" {'goal':>8s}")
    for k, (label, goal, unit) in GOALS.items():
        cells = []
        for n in names:
            v = table[n][k]
            cells.append(f"{'-':>22s}" if v is None else f"{v:19.2f} {unit:2s}")
        ok = table["this checkout"][k]
        mark = "" if ok is None or goal is None else (" met" if ok <= goal else " missed")
        print(f"{label:44s} " + " ".join(cells) + f" {'-' if goal is None else '<= ' + str(goal):>8s}{mark}")
    res = dict(repos=repos, rounds=runs, best=table, goals={k: g[1] for k, g in GOALS.items()},
               time=time.strftime("%Y-%m-%d %H:%M:%S"), cores=os.cpu_count())
    write_results(res, "latency.json")
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, len(GOALS), figsize=(2.8 * len(GOALS), 3.6))
    for ax, (k, (label, goal, unit)) in zip(axes, GOALS.items()):
        vals = [table[n][k] or 0.0 for n in names]
        ax.bar(range(len(names)), vals, color=["0.6", "C0"][-len(names):])
        if goal is not None:
            ax.axhline(goal, color="C3", ls="--", lw=1, label=f"goal {goal} {unit}")
            ax.legend(fontsize=7)
        ax.set_xticks(range(len(names)), [n.split(" (")[0] for n in names], fontsize=7)
        ax.set_title(label, fontsize=8)
        ax.set_ylabel(unit)
    fig.suptitle("synkhronos fixed costs, n=2 (best of rounds; lower is better)", fontsize=9)
    fig.tight_layout()
    png = os.path.join(RESULTS, "latency.png")
    fig.savefig(png, dpi=110)
    print(png)


if __name__ == "__main__":
    main()
