"""A timeline of a training run with a straggler, and how to read it.

Three CPU ranks train a small MLP for 12 steps; rank 2 computes each gradient 20 ms late
(``exchange.straggle``).  ``synk.fork(timeline=...)`` records every rank; this script
prints, per rank, its time in commands, in collectives and waiting, and whom it waited on,
then draws the trace: ``benchmarks/results/timeline.json`` (open it in
https://ui.perfetto.dev) and ``timeline.png``.

Usage: python benchmarks/timeline_example.py [--delay SECONDS] [--steps N]"""
import argparse
import json
import os
import sys

import numpy as np

from common import RESULTS, pyplot

COLORS = {"command": "#9ecae1", "collective": "#fd8d3c", "wait": "#d9d9d9", "compile": "#a1d99b"}


def run(path, delay, steps):
    import pytensor.tensor as pt

    import synkhronos as synk
    from synkhronos.extensions import exchange, train, updates
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demos"))
    from losses import picked
    from mnist_mlp import mlp_params
    synk.fork(3, timeline=path)
    try:
        x, y = pt.matrix("x", dtype="float64"), pt.ivector("y")
        params, forward = mlp_params([64, 256, 256, 10], 0)
        loss = exchange.straggle(pt.mean(-picked(pt.special.log_softmax(forward(x), axis=-1), y, 10)), {2: delay})
        step = train.make_train_function(loss, params, [x, y], updates.sgd, learning_rate=0.1)
        synk.distribute()
        rng = np.random.default_rng(0)
        X, Y = rng.random((96, 64)), rng.integers(0, 10, 96).astype("int32")
        for _ in range(steps):
            step(X, Y)
    finally:
        synk.close()


def summary(events):
    by_rank = {}
    for e in events:
        if e["ph"] != "X":
            continue
        r = by_rank.setdefault(e["pid"], {"command": 0.0, "collective": 0.0, "wait": 0.0, "compile": 0.0,
                                          "waited on": {}})
        r[e["cat"]] += e["dur"] / 1e3
        for other in e["args"].get("waiting on ranks", ()):
            r["waited on"][other] = r["waited on"].get(other, 0) + 1
    print("rank  in commands   in collectives   waiting     waited on (times)")
    for rank in sorted(by_rank):
        r = by_rank[rank]
        print(f"{rank:4d}  {r['command']:9.1f} ms  {r['collective']:11.1f} ms  {r['wait']:7.1f} ms  {r['waited on']}")
    return by_rank


def draw(events, png):
    plt = pyplot()
    if plt is None:
        return
    # the steady steps: from the third training call on (the first ones compile), without the
    # idle waits for the next command
    starts = sorted(e["ts"] for e in events if e["ph"] == "X" and e["name"] == "call of function train_grad"
                    and e["pid"] == 0)
    t0 = starts[2] if len(starts) > 2 else 0.0
    spans = [e for e in events if e["ph"] == "X" and e["cat"] != "compile" and e["ts"] >= t0
             and e["name"] != "wait: the next command"]
    fig, ax = plt.subplots(figsize=(11, 3.2))
    depth = {"command": 0.0, "collective": 0.35, "wait": 0.35}
    for e in spans:
        y = e["pid"] + depth.get(e["cat"], 0)
        ax.barh(y, e["dur"] / 1e3, left=(e["ts"] - t0) / 1e3, height=0.3 if e["cat"] != "command" else 0.7,
                color=COLORS[e["cat"]], edgecolor="none")
    ax.set_yticks(sorted({e["pid"] for e in spans}))
    ax.set_yticklabels([f"rank {r}" for r in sorted({e["pid"] for e in spans})])
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    ax.set_title("synk.fork(timeline=...): 3 ranks, rank 2 computes 20 ms late; steps 3 on (commands blue, "
                 "collectives orange, waits for other ranks grey)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"saved {png}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--delay", type=float, default=0.02)
    ap.add_argument("--steps", type=int, default=12)
    a = ap.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, "timeline.json")
    run(path, a.delay, a.steps)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    summary(events)
    draw(events, os.path.join(RESULTS, "timeline.png"))


if __name__ == "__main__":
    main()
