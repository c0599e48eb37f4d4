"""Partial FC: a classifier sharded by class over the ranks, trained with in-graph collectives.

    .venv/bin/python demos/partial_fc.py                     # all cores, sklearn digits
    .venv/bin/python demos/partial_fc.py --n-parallel 3 --steps 200 --float64

Large-scale classification (face recognition with millions of identities: Tencent TFace,
InsightFace's "partial FC") cannot replicate the last layer on every device: its weight is
``embedding x classes``.  Each rank holds only its slice of the classes, and the batch's
features travel instead:

1. every rank computes the features of its shard of the batch with a small network
   (``tanh`` hidden layer, linear embedding; replicated, as in data parallelism);
2. ``ops.all_gather`` gives every rank the features (and labels) of the whole batch;
3. every rank computes the logits of the whole batch for its own classes (``Wt`` holds
   rows ``[lo, hi)`` of the classifier, set per rank with ``synk.scatter``);
4. the softmax over all classes: the row maximum through ``ops.all_reduce(max)``, the
   normaliser through ``ops.all_reduce(sum)``, the target logit (held by one rank) through
   ``ops.all_reduce(sum)``; every rank then has the loss of every sample;
5. ``pytensor.grad``: each rank gets the gradient of its class slice directly, and the
   gradient of the features flows back through the all-gather (a reduce-scatter: each rank
   gets its own samples' feature gradients, summed over the class shards); the replicated
   network's gradients are summed with ``ops.all_reduce(sum)`` inside the same graph;
6. plain SGD, applied by every rank to what it holds.

The same model is trained serially (one process, the whole classifier, the same data,
initial values and steps) and the parameters are compared: in float64 they agree to
rounding (~1e-15); in float32 they differ by rounding amplified over the steps.  The last
line starts with ``RESULT:``.
"""
import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n-parallel", type=int, default=None, help="ranks (default: every usable core)")
    p.add_argument("--steps", type=int, default=100, help="SGD steps (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=128, help="rows per step, all ranks (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=64, help="hidden units (default: %(default)s)")
    p.add_argument("--embed", type=int, default=32, help="feature (embedding) size (default: %(default)s)")
    p.add_argument("--learning-rate", type=float, default=0.5, help="SGD step (default: %(default)s)")
    p.add_argument("--float64", action="store_true", help="train in float64 (float32 otherwise)")
    p.add_argument("--seed", type=int, default=0, help="initial values and batches (default: %(default)s)")
    p.add_argument("--mnist-dir", default=None, help="MNIST idx files instead of scikit-learn's digits")
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "hidden", "embed"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.n_parallel is not None and args.n_parallel < 1:
        p.error("--n-parallel must be at least 1")
    return args


# ---- the model ----------------------------------------------------------------------------------

def init_params(n_in, hidden, embed, n_classes, seed, dtype):
    """Initial values: the replicated network (W0, b0, W1) and the classifier (Wt: one row
    per class, bc), all from ``seed``."""
    rng = np.random.default_rng(seed)

    def u(a, b, shape):
        lim = np.sqrt(6.0 / (a + b))
        return rng.uniform(-lim, lim, shape).astype(dtype)
    return {"W0": u(n_in, hidden, (n_in, hidden)), "b0": np.zeros(hidden, dtype),
            "W1": u(hidden, embed, (hidden, embed)),
            "Wt": u(embed, n_classes, (n_classes, embed)), "bc": np.zeros(n_classes, dtype)}


def features(x, p):
    import pytensor.tensor as pt
    return pt.tanh(x @ p["W0"] + p["b0"]) @ p["W1"]


def partial_fc_loss(F, Y, Wt, bc):
    """Per-sample softmax cross-entropy of the gathered batch (features ``F``, labels ``Y``)
    over all classes, from this rank's class rows ``Wt``/``bc``.  Returns ``(loss, correct)``,
    identical on every rank."""
    import pytensor.tensor as pt
    from pytensor.gradient import disconnected_grad
    from synkhronos import ops
    logits = F @ Wt.T + bc                                   # (batch, this rank's classes)
    # the max only keeps exp() in range; its gradient cancels, so it is not propagated
    m = disconnected_grad(ops.all_reduce(pt.max(logits, axis=1), "max"))
    s = ops.all_reduce(pt.exp(logits - m[:, None]).sum(axis=1), "sum")
    n_cls = ops.all_gather(Wt.shape[:1])                     # classes of every rank
    local = Y - n_cls[:ops.this_rank()].sum()                # labels as this rank's rows
    mine = pt.and_(pt.ge(local, 0), pt.lt(local, Wt.shape[0]))
    picked = logits[pt.arange(Y.shape[0]), pt.clip(local, 0, Wt.shape[0] - 1)]
    t = ops.all_reduce(pt.switch(mine, picked, 0), "sum")    # the target's logit, from its rank
    return pt.log(s) + m - t, pt.ge(t, m)


def build_synk(params, lr, dtype):
    """Shared variables and the synkhronos functions of partial FC (``synk.fork()`` first;
    ``synk.distribute()`` and ``scatter_classifier`` after)."""
    import pytensor
    import pytensor.tensor as pt
    import synkhronos as synk
    from synkhronos import ops
    p = {k: pytensor.shared(v, name=k) for k, v in params.items()}
    x, y = pt.matrix("x", dtype=dtype), pt.ivector("y")
    F, Y = ops.all_gather(features(x, p)), ops.all_gather(y)
    loss, correct = partial_fc_loss(F, Y, p["Wt"], p["bc"])
    # every rank has the whole batch's loss: each counts 1/n of it, so that the gradients,
    # summed over the ranks, are those of the mean loss
    cost = pt.mean(loss) / pt.cast(ops.n_ranks(), dtype)
    names = ["W0", "b0", "W1", "Wt", "bc"]
    grads = dict(zip(names, pytensor.grad(cost, [p[k] for k in names])))
    step = pt.constant(lr, dtype=dtype)
    updates = []
    for k in names:
        g = grads[k] if k in ("Wt", "bc") else ops.all_reduce(grads[k], "sum")   # replicated: sum
        updates.append((p[k], p[k] - step * g))
    train = synk.function([x, y], [(pt.mean(loss), None), (pt.mean(correct), None)], updates=updates)
    evaluate = synk.function([x, y], [(pt.mean(loss), None), (pt.mean(correct), None)])
    return p, train, evaluate


def scatter_classifier(p, params):
    """Rank r gets classes ``[C*r//n, C*(r+1)//n)``: its rows of ``Wt`` and ``bc``."""
    import synkhronos as synk
    synk.scatter([p["Wt"], p["bc"]], [params["Wt"], params["bc"]])


def build_serial(params, lr, dtype):
    """The full model in one process: the same loss, the whole classifier."""
    import pytensor
    import pytensor.tensor as pt
    from pytensor.gradient import disconnected_grad
    p = {k: pytensor.shared(v.copy(), name=k) for k, v in params.items()}
    x, y = pt.matrix("x", dtype=dtype), pt.ivector("y")
    logits = features(x, p) @ p["Wt"].T + p["bc"]
    m = disconnected_grad(pt.max(logits, axis=1))
    t = logits[pt.arange(y.shape[0]), y]
    loss = pt.log(pt.exp(logits - m[:, None]).sum(axis=1)) + m - t
    correct = pt.ge(t, pt.max(logits, axis=1))
    names = list(p)
    grads = pytensor.grad(pt.mean(loss), [p[k] for k in names])
    step = pt.constant(lr, dtype=dtype)
    outs = [pt.mean(loss), pt.mean(correct)]
    train = pytensor.function([x, y], outs, updates=[(p[k], p[k] - step * g) for k, g in zip(names, grads)])
    evaluate = pytensor.function([x, y], outs)
    return p, train, evaluate


def batches(n_train, batch_size, steps, seed):
    """The rows of every step (the same for both runs): shuffled epochs, full batches."""
    rng = np.random.default_rng(seed + 1)
    out, perm = [], np.zeros(0, np.int64)
    while len(out) < steps:
        if len(perm) < batch_size:
            perm = np.concatenate([perm, rng.permutation(n_train)])
        out.append(perm[:batch_size])
        perm = perm[batch_size:]
    return out


def max_param_diff(synk_values, serial_p):
    return max(float(np.max(np.abs(np.asarray(synk_values[k], np.float64) - serial_p[k].get_value())))
               for k in serial_p)


def main(argv=None):
    args = parse_args(argv)
    import digits
    import synkhronos as synk
    dtype = "float64" if args.float64 else "float32"
    data = digits.load(args.mnist_dir, seed=args.seed)
    (X, y), (X_te, y_te) = data["train"], data["test"]
    X, X_te = X.astype(dtype), X_te.astype(dtype)
    n_classes = int(max(y.max(), y_te.max())) + 1
    params = init_params(X.shape[1], args.hidden, args.embed, n_classes, args.seed, dtype)
    synk.fork(n_parallel=args.n_parallel)
    try:
        n = synk.session_info().n
        if args.batch_size < n:
            raise SystemExit(f"--batch-size {args.batch_size} is smaller than the {n} ranks")
        p, train, evaluate = build_synk(params, args.learning_rate, dtype)
        synk.distribute()
        scatter_classifier(p, params)
        per_rank = synk.get_lengths(p["Wt"])
        item = np.dtype(dtype).itemsize
        print(f"data: {data['name']}, {len(y)} train / {len(y_te)} test rows, {n_classes} classes; "
              f"{n} rank(s): classes per rank {list(per_rank)}, classifier "
              f"{max(per_rank) * (args.embed + 1) * item} bytes per rank "
              f"(replicated: {n_classes * (args.embed + 1) * item})", flush=True)
        steps = batches(len(y), args.batch_size, args.steps, args.seed)
        X_d, y_d = synk.data(X), synk.data(y)

        sp, s_train, s_eval = build_serial(params, args.learning_rate, dtype)
        s_train(X[steps[0]], y[steps[0]])                    # warm the JIT (then reset)
        for k, v in params.items():
            sp[k].set_value(v.copy())
        t0 = time.perf_counter()
        for idx in steps:
            s_loss, _ = s_train(X[idx], y[idx])
        t_serial = (time.perf_counter() - t0) / len(steps)

        train(X_d, y_d, batch=steps[0])                       # warm the JIT (then reset)
        for name in ("W0", "b0", "W1"):
            synk.broadcast(p[name], params[name])
        scatter_classifier(p, params)
        t0 = time.perf_counter()
        for i, idx in enumerate(steps):
            loss, acc = train(X_d, y_d, batch=idx)
            if i == 0 or (i + 1) % max(1, len(steps) // 5) == 0:
                print(f"step {i + 1:4d}/{len(steps)}  loss {float(loss):.4f}  batch accuracy {float(acc):.3f}",
                      flush=True)
        t_synk = (time.perf_counter() - t0) / len(steps)

        got = {k: synk.gather(p[k], nd_up=0) if k in ("Wt", "bc") else p[k].get_value() for k in params}
        spread = max(float(np.max(np.abs(np.asarray(synk.gather(p[k], nd_up=1), np.float64)
                                          - got[k]))) for k in ("W0", "b0", "W1"))
        diff = max_param_diff(got, sp)
        te_loss, te_acc = evaluate(X_te, y_te)
        s_te_loss, s_te_acc = s_eval(X_te, y_te)
        print(f"final training loss {float(loss):.6f} (serial {float(s_loss):.6f}); test loss "
              f"{float(te_loss):.6f} (serial {float(s_te_loss):.6f})")
        print(f"replicated network identical on every rank: max spread {spread:.1e}")
        print(f"time per step: serial {t_serial * 1e3:.2f} ms, partial FC over {n} rank(s) {t_synk * 1e3:.2f} ms")
        print(f"RESULT: partial FC {n} rank(s), {n_classes} classes, {dtype}, {len(steps)} steps: test accuracy "
              f"{float(te_acc):.4f} (serial {float(s_te_acc):.4f}); max |parameter difference| vs serial "
              f"{diff:.3e}", flush=True)
        return diff
    finally:
        synk.close()


if __name__ == "__main__":
    main()
