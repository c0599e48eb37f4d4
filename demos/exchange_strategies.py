"""Compare exchange strategies on the digits task: BSP, fp16 BSP, EASGD, local SGD and the
asynchronous parameter server, each training the same MLP from the same initial weights.

    .venv/bin/python demos/exchange_strategies.py
    .venv/bin/python demos/exchange_strategies.py --n-parallel 3 --steps 600
    .venv/bin/python demos/exchange_strategies.py --straggler 0.005 --plot /tmp/strategies.png

Strategies (``synkhronos.extensions.exchange``):

* ``bsp``: every step, the gradient of the global batch (``--batch-size`` rows, split over
  the ranks) is all-reduced in float32, then the update rule runs on every rank;
* ``fp16``: the same, the gradient all-reduced in float16 with error feedback;
* ``easgd``: every rank takes ``--tau`` local steps on its share of each batch, then an
  elastic exchange (strength ``--alpha``) with the center, which is evaluated;
* ``local``: local steps, parameters averaged every ``--k`` steps;
* ``ps``: the master serves as parameter server; every other rank is a worker computing
  gradients on batches of ``batch-size / n`` rows of its shard, at its own pace; gradients
  staler than ``--max-staleness`` are dropped.

A "step" below is a batch of ``--batch-size`` rows of training data processed (all ranks
together); the parameter server applies n updates of ``batch-size / n`` rows per step.
The strategies train in rounds of ``--eval-every`` steps, each in turn (so that other
programs' load hits all alike); test accuracy is measured after each round in the master
(not counted in the wall time).  ``--straggler S`` makes the last rank S seconds slower per gradient (a
``straggle`` op in the loss), to show who waits for a slow worker.  Prints a table, saves
the plot (accuracy against wall time and against steps) and the figures as JSON."""
import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits  # noqa: E402  (demos/digits.py)
from losses import picked  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATEGIES = ("bsp", "fp16", "easgd", "local", "ps")
LABELS = {"bsp": "BSP (float32 all-reduce)", "fp16": "BSP, fp16 all-reduce + error feedback",
          "easgd": "EASGD", "local": "local SGD", "ps": "parameter server (async)"}


def positive_int(text):
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def parse_args(argv=None):
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(description=doc[0], epilog="examples:\n" + doc[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-parallel", type=positive_int, default=None, metavar="N",
                   help="ranks (default: one per usable core; the parameter server needs 2 or more)")
    p.add_argument("--steps", type=positive_int, default=480, help="steps per strategy (default 480)")
    p.add_argument("--batch-size", type=positive_int, default=64, metavar="ROWS",
                   help="rows per step over all ranks (default 64)")
    p.add_argument("--hidden", type=positive_int, default=512, help="units per hidden layer (default 512)")
    p.add_argument("--learning-rate", type=float, default=0.05, help="SGD step (default 0.05)")
    p.add_argument("--momentum", type=float, default=0.0, help="momentum (default 0: plain SGD)")
    p.add_argument("--tau", type=positive_int, default=4, help="EASGD local steps per exchange (default 4)")
    p.add_argument("--alpha", type=float, default=None,
                   help="EASGD elastic strength (default 0.9 / n)")
    p.add_argument("--k", type=positive_int, default=8, help="local SGD: steps between averages (default 8)")
    p.add_argument("--max-staleness", type=int, default=None,
                   help="parameter server: staleness bound (default 2 x workers)")
    p.add_argument("--eval-every", type=positive_int, default=16,
                   help="steps between evaluations (default 16: local SGD and EASGD are evaluated right "
                        "after an exchange when it is a multiple of --k and --tau)")
    p.add_argument("--target", type=float, default=0.95,
                   help="accuracy for the time-to-target column (default 0.95)")
    p.add_argument("--straggler", type=float, default=0.0, metavar="S",
                   help="seconds the last rank waits per gradient (default 0)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma-separated subset of {','.join(STRATEGIES)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mnist-dir", default=None, help="MNIST idx files instead of scikit-learn's digits")
    p.add_argument("--plot", default=os.path.join(ROOT, "benchmarks", "results", "exchange.png"),
                   help="where to save the plot (default benchmarks/results/exchange.png; '' for none)")
    p.add_argument("--json", default=None, help="where to save the figures (default: next to the plot)")
    a = p.parse_args(argv)
    a.strategies = [s.strip() for s in a.strategies.split(",") if s.strip()]
    bad = [s for s in a.strategies if s not in STRATEGIES]
    if bad:
        p.error(f"unknown strategies {bad}; choose from {list(STRATEGIES)}")
    if a.eval_every > a.steps:
        a.eval_every = a.steps
    return a


def init_params(sizes, seed):
    rng = np.random.default_rng(seed)
    out = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        lim = np.sqrt(6.0 / (a + b)) * (np.sqrt(2.0) if i < len(sizes) - 2 else 1.0)
        out += [rng.uniform(-lim, lim, (a, b)).astype("float32"), np.zeros(b, "float32")]
    return out


def forward(x, ps):
    import pytensor.tensor as pt
    h = x
    for i in range(0, len(ps) - 2, 2):
        h = pt.maximum(h @ ps[i] + ps[i + 1], 0)
    return h @ ps[-2] + ps[-1]


def main(argv=None):
    args = parse_args(argv)
    import pytensor
    import pytensor.tensor as pt
    import synkhronos as synk
    from synkhronos.extensions import exchange, train, updates

    data = digits.load(args.mnist_dir, seed=args.seed)
    X_tr, y_tr = data["train"]
    X_te, y_te = data["test"]
    X_tr, X_te = np.ascontiguousarray(X_tr, np.float32), np.ascontiguousarray(X_te, np.float32)
    n = synk.fork(args.n_parallel)
    try:
        if n < 2 and "ps" in args.strategies:
            print("the parameter server needs 2 ranks or more: skipping it")
            args.strategies.remove("ps")
        B = max(n, args.batch_size - args.batch_size % n)
        sizes = [X_tr.shape[1], args.hidden, args.hidden, 10]
        init = init_params(sizes, args.seed)
        x, y = pt.matrix("x", dtype="float32"), pt.ivector("y")

        def loss_of(ps):
            logp = pt.special.log_softmax(forward(x, ps), axis=-1)
            loss = pt.mean(-picked(logp, y, 10))
            return exchange.straggle(loss, {n - 1: args.straggler}) if args.straggler > 0 else loss

        rule = updates.momentum if args.momentum > 0 else updates.sgd
        kw = dict(learning_rate=args.learning_rate)
        if args.momentum > 0:
            kw["momentum"] = args.momentum
        models, steps = {}, {}
        for s in args.strategies:
            ps = [pytensor.shared(v.copy(), name=f"{s}_{'Wb'[i % 2]}{i // 2}") for i, v in enumerate(init)]
            models[s] = ps
            loss = loss_of(ps)
            if s == "bsp":
                steps[s] = train.make_train_function(loss, ps, [x, y], rule, name=s, **kw)
            elif s == "fp16":
                steps[s] = train.make_train_function(loss, ps, [x, y], rule, name=s, compress="fp16", **kw)
            elif s == "easgd":
                steps[s] = exchange.make_train_function(loss, ps, [x, y], rule, name=s,
                                                        exchange=exchange.EASGD(args.tau, args.alpha), **kw)
            elif s == "local":
                steps[s] = exchange.make_train_function(loss, ps, [x, y], rule, name=s,
                                                        exchange=exchange.LocalSGD(args.k), **kw)
            else:
                steps[s] = exchange.ParameterServer(loss, ps, [x, y], rule, name=s,
                                                    max_staleness=args.max_staleness, **kw)
        # evaluation in the master: one compiled function, the weights as inputs
        w_in = [pt.matrix(f"w{i}", dtype="float32") if v.ndim == 2 else pt.vector(f"w{i}", dtype="float32")
                for i, v in enumerate(init)]
        logits = forward(x, w_in)
        f_eval = pytensor.function([x, y] + w_in, pt.sum(pt.eq(pt.argmax(logits, axis=-1), y)))
        synk.distribute()
        X_d, y_d = synk.data(X_tr), synk.data(y_tr)
        rng = np.random.default_rng(args.seed + 1)
        order = [rng.permutation(len(X_tr)) for _ in range(args.steps * B // len(X_tr) + 2)]
        order = np.concatenate(order)
        batches = [np.sort(order[t * B:(t + 1) * B]) for t in range(args.steps)]

        def weights(s):
            if s == "easgd":
                c = steps[s].center.get_value()
                out, a = [], 0
                for v in init:
                    out.append(c[a:a + v.size].reshape(v.shape))
                    a += v.size
                return out
            return [p.get_value(borrow=True) for p in models[s]]

        def accuracy(s):
            return float(f_eval(X_te, y_te, *weights(s))) / len(y_te)

        print(f"data: {data['name']}: {len(X_tr)} train, {len(X_te)} test; MLP {'-'.join(map(str, sizes))}; "
              f"{n} ranks; batch {B} ({B // n} per rank); {rule.__name__} lr {args.learning_rate:g}; "
              f"{args.steps} steps" + (f"; rank {n - 1} straggles {args.straggler:g} s per gradient"
                                       if args.straggler > 0 else ""))
        for s in args.strategies:
            prepare(s, steps[s], models[s], init, batches, X_d, y_d, B, n, synk)
        results = {s: dict(seconds=0.0, t=[0.0], steps=[0], acc=[accuracy(s)], updates=0, dropped=0,
                           staleness=[], note="") for s in args.strategies}
        # in rounds: every strategy trains --eval-every steps in turn, so that other programs'
        # load on the machine hits them all alike
        done = 0
        while done < args.steps:
            k = min(args.eval_every, args.steps - done)
            for s in args.strategies:
                train_chunk(s, steps[s], results[s], batches, X_d, y_d, B, n, k, accuracy)
            done += k
        for s in args.strategies:
            finish(s, steps[s], results[s], B, n)
    finally:
        synk.close()
    print()
    print(summary_table(results, args))
    save(results, args, n, B)
    return results


def prepare(s, step, params, init, batches, X_d, y_d, B, n, synk):
    """Warm up (compile), then reset to the initial weights with the rule's state zeroed."""
    if s == "ps":
        step.run(X_d, y_d, steps=2, batch_size=B // n, verbose=False)       # compiles, warms
        for p, v in zip(params, init):
            p.set_value(v.copy())
        for v in step.update_function.get_shared():                       # the rule's state
            if all(v is not p for p in params) and v is not step.grad_shared:
                v.set_value(np.zeros_like(v.get_value()))
        synk.broadcast(params)
        return
    step(X_d, y_d, batch=batches[0])
    step(X_d, y_d, batch=batches[1])
    if s == "easgd":
        step.exchange()
    first = {id(p): v for p, v in zip(params, init)}
    values = []
    for v in step.state_vars:              # parameters back to the initial weights, state zeroed
        if id(v) in first:
            values.append(first[id(v)].copy())
        elif s == "easgd" and v is step.center:
            values.append(np.concatenate([w.reshape(-1) for w in init]))
        else:
            values.append(np.zeros_like(v.get_value()))
    if s in ("easgd", "local"):
        step.restore(values, t=0)
    else:
        step.restore(values)
    if s == "easgd":
        step.exchanges = 0


def train_chunk(s, step, r, batches, X_d, y_d, B, n, k, accuracy):
    """``k`` more steps of strategy ``s`` (timed), then its test accuracy (not timed)."""
    done = r["steps"][-1]
    t0 = time.perf_counter()
    if s == "ps":
        res = step.run(X_d, y_d, steps=k * n, batch_size=B // n, verbose=False, sync=False)
        r["dropped"] += res.dropped
        r["updates"] += res.applied
        r["staleness"] += res.staleness
    else:
        for t in range(done, done + k):
            step(X_d, y_d, batch=batches[t])
        r["updates"] += k
    r["seconds"] += time.perf_counter() - t0
    r["t"].append(r["seconds"])
    r["steps"].append(done + k)
    r["acc"].append(accuracy(s))


def finish(s, step, r, B, n):
    if s == "ps":
        st = r["staleness"]
        r["note"] = (f"  ({r['updates']} updates of {B // n} rows, {r['dropped']} stale gradients dropped, "
                     f"staleness mean {np.mean(st) if st else 0:.2f}, max {max(st) if st else 0})")
    elif s == "easgd":
        r["note"] = f"  ({step.exchanges} exchanges)"
    r.pop("staleness", None)


def summary_table(results, args):
    rows = [("strategy", "steps", "updates", "train s", "steps/s", f"t to {args.target:.0%}", "final acc",
             "best acc")]
    for s, r in results.items():
        hit = next((t for t, a in zip(r["t"], r["acc"]) if a >= args.target), None)
        rows.append((s, str(r["steps"][-1]), str(r["updates"]), f"{r['seconds']:.2f}",
                     f"{r['steps'][-1] / r['seconds']:.0f}", "-" if hit is None else f"{hit:.2f} s",
                     f"{r['acc'][-1]:.4f}", f"{max(r['acc']):.4f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    notes = [f"{s}:{r['note']}" for s, r in results.items() if r["note"]]
    return "\n".join(lines + notes)


def save(results, args, n, B):
    path = args.plot
    jpath = args.json or (os.path.splitext(path)[0] + ".json" if path else None)
    if jpath:
        os.makedirs(os.path.dirname(os.path.abspath(jpath)), exist_ok=True)
        with open(jpath, "w") as fh:
            json.dump(dict(n=n, batch=B, args={k: v for k, v in vars(args).items() if k not in ("plot", "json")},
                           results=results), fh, indent=1)
        print(f"saved {jpath}")
    if not path:
        return
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for s, r in results.items():
        axes[0].plot(r["t"], r["acc"], marker=".", label=LABELS[s])
        axes[1].plot(r["steps"], r["acc"], marker=".", label=LABELS[s])
    axes[0].set_xlabel("training wall time (s)")
    axes[1].set_xlabel(f"steps ({B}-row batches of training data processed)")
    for ax in axes:
        ax.set_ylabel("test accuracy")
        ax.set_ylim(max(0.0, min(min(r["acc"]) for r in results.values()) - 0.02), 1.0)
        ax.grid(alpha=0.3)
    axes[1].legend(loc="lower right", fontsize=8)
    extra = f", rank {n - 1} straggling {args.straggler:g} s/gradient" if args.straggler > 0 else ""
    fig.suptitle(f"Exchange strategies on digits: {n} ranks, batch {B}{extra}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
