"""Where a data-parallel training step's time goes (the MLP 784-512-512-10 of
``bench_training.py --torch``, Adam, float32, batch gathered by a shuffled index), at n=2,
through the public API only:

* the gradient call alone (``step.grad_function``), the all-reduce of the flat gradient
  right after it (``synk.all_reduce``, the gradient freshly replaced: copy-in included),
  the update call alone (``step.update_function``), and the chained step (one round trip);
* the sharded step (``shard_updates=True``: reduce-scatter, 1/n of Adam, all-gather, in
  one call), and the bound of any data-parallel step of this model here: one call in which
  each rank computes its gradient and the whole Adam update, nothing exchanged;
* PyTensor in the master on the whole batch, with one and with two BLAS threads;
* the chained step right after a two-thread PyTensor run, against right after a one-thread
  one: OpenBLAS keeps its second thread spinning for a while after a two-thread call,
  which is why ``bench_training.py`` gives every contender untimed steps first;
* the model's widest product, ``(batch x H) @ (H x H)``: in the master on one and on two
  BLAS threads, on half the rows on one thread, and on half the rows in each of the two
  ranks at once (one call): whether the ranks can beat BLAS threads on it at all.

Usage: python benchmarks/bench_step_parts.py [--model mlp784|mlp|cnn] [--batches 64,256] [--reps 9]
(``--model mlp``: the MLP demo's 64-1024-1024-10, e.g. at its batch, ``--batches 512``;
``--model cnn``: the README's main job, ``demos/mnist_cnn.py``'s CNN, e.g. ``--batches 128``;
no widest product for it: its products are small.)
Prints a table and saves benchmarks/results/step_parts.json (step_parts_<model>.json for
another model)."""
import argparse
import os
import time

import numpy as np

import models                                # the model and data (benchmarks/models.py)
from common import call_times, write_results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="64,256", help="comma-separated batch sizes (default: 64,256)")
    ap.add_argument("--model", default="mlp784", choices=["mlp784", "mlp", "cnn"],
                    help="mlp784 (default), mlp (the MLP demo's model) or cnn (the README's main job)")
    ap.add_argument("--reps", type=int, default=9, help="timed runs of 20 steps each (medians)")
    args = ap.parse_args()
    import pytensor
    pytensor.config.floatX = "float32"
    import pytensor.tensor as pt
    from threadpoolctl import threadpool_limits

    import synkhronos as synk
    from synkhronos.extensions import train, updates

    rng = np.random.default_rng(0)
    synk.fork(2)
    out = {}
    try:
        x = pt.matrix("x", dtype="float32")
        y, loss, params = models.build(args.model, x)
        step = train.make_train_function(loss, params, [x, y], updates.adam, learning_rate=1e-3)
        y_s, loss_s, params_s = models.build(args.model, x)
        sharded = train.make_train_function(loss_s, params_s, [x, y_s], updates.adam, learning_rate=1e-3,
                                            shard_updates=True)
        # the bound: each rank's own gradient and whole Adam update, nothing exchanged
        y_b, loss_b, params_b = models.build(args.model, x)
        _, local_updates, _ = updates.adam(updates.Reduced(pytensor.grad(loss_b, params_b)), params_b,
                                           learning_rate=1e-3)
        local = synk.function([x, y_b], loss_b, updates=local_updates, name="no_exchange")
        H = models.MODELS[args.model].get("sizes", (0, 0))[1]      # (the CNN: no widest product)
        if H:
            W = pytensor.shared(rng.random((H, H), dtype=np.float32), name="W")
            a = pt.matrix("a", dtype="float32")
            product = synk.function([a], (pt.sum(a @ W), "sum"), name="product")   # each rank: its rows
        synk.distribute()
        X, Y = models.model_data(args.model, rng)
        Xd, Yd = synk.data(X), synk.data(Y)
        grad_var = step.grad_shared
        for B in [int(b) for b in args.batches.split(",")]:
            idxs = [rng.permutation(len(X))[:B] for _ in range(20)]

            def each(fn):
                return lambda: [fn(i) for i in idxs]

            def serial(i):
                return step.serial(X[i], Y[i])

            def grad_then_reduce(i):
                step.grad_function(Xd, Yd, batch=i)
                synk.all_reduce(grad_var, op="avg")

            def after(threads):
                def run():
                    with threadpool_limits(limits=threads):
                        each(serial)()
                    t = time.perf_counter()
                    each(lambda i: step(Xd, Yd, batch=i))()
                    return time.perf_counter() - t
                return run
            parts = {"gradient call": each(lambda i: step.grad_function(Xd, Yd, batch=i)),
                     "gradient call + all_reduce": each(grad_then_reduce),
                     "update call": each(lambda i: step.update_function()),
                     "chained step (one round trip)": each(lambda i: step(Xd, Yd, batch=i)),
                     "sharded step (shard_updates=True, one round trip)": each(lambda i: sharded(Xd, Yd, batch=i)),
                     "bound: gradient + whole update per rank, no exchange": each(lambda i: local(Xd, Yd, batch=i))}
            for fn in parts.values():
                fn()                                             # warm: JIT, caches
            row = {k: float(np.median(call_times(fn, args.reps))) / len(idxs) for k, fn in parts.items()}
            for threads in (1, 2):
                with threadpool_limits(limits=threads):
                    each(serial)()
                    row[f"PyTensor, {threads} thread(s), whole batch"] = float(
                        np.median(call_times(each(serial), args.reps))) / len(idxs)
            for threads in (1, 2):
                row[f"chained step right after a {threads}-thread PyTensor run"] = float(
                    np.median([after(threads)() for _ in range(args.reps)])) / len(idxs)
            if H:
                row.update(widest_product(product, W, rng, B, H, args.reps))
            out[B] = row
            print(f"\n{models.MODELS[args.model]['desc']}, Adam, batch {B}, n=2: "
                  f"time per step (median of {args.reps} x 20)")
            for k, v in row.items():
                if k.startswith("product"):
                    k = k.replace("product", f"GEMM (rows x {H}) @ ({H} x {H}),", 1)
                print(f"  {k:58s} {v * 1e3:8.3f} ms")
    finally:
        synk.close()
    write_results(dict(model=models.MODELS[args.model]["desc"], results=out, cores=os.cpu_count(),
                       time=time.strftime("%Y-%m-%d %H:%M:%S")),
                  "step_parts.json" if args.model == "mlp784" else f"step_parts_{args.model}.json")


def widest_product(product, W, rng, B, H, reps):
    """The times of ``(B x H) @ (H x H)``: in the master on one and two BLAS threads, on half
    the rows on one thread, and on half the rows in each rank at once (``product``)."""
    from threadpoolctl import threadpool_limits

    import synkhronos as synk
    A = rng.random((B, H), dtype=np.float32)
    Ad, Wv = synk.data(A), W.get_value()
    gemm = {f"one thread, {B} rows": (1, A), f"two threads, {B} rows": (2, A),
            f"one thread, {B // 2} rows": (1, A[:B // 2])}
    row = {}
    for k, (threads, rows) in gemm.items():
        with threadpool_limits(limits=threads):
            row[f"product {k}"] = float(np.median(call_times(lambda: rows @ Wv, reps * 3, 10)))
    product(Ad)
    row[f"product {B // 2} rows in each rank at once (n=2)"] = float(
        np.median(call_times(lambda: product(Ad), reps * 3, 10)))
    return row


if __name__ == "__main__":
    main()
