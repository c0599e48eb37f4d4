"""Train a small CNN on real handwritten digits, data-parallel over CPU worker processes.

    .venv/bin/python demos/mnist_cnn.py                      # all cores, sklearn digits
    .venv/bin/python demos/mnist_cnn.py --n-parallel 1       # master only
    .venv/bin/python demos/mnist_cnn.py --data-pattern scatter
    .venv/bin/python demos/mnist_cnn.py --mnist-dir ~/data/mnist --batch-size 256

The model (``demos/layers.py``, built from pytensor-ml layers): two stages of 3x3
convolution (``--channels``, 16 and 32 by default, "same" padding), relu and 2x2 max
pooling, then a dense relu layer (``--hidden``) and a 10-way softmax; float32.  The run
follows ``demos/mnist_mlp.py`` step by step:

1. build the model and its data-parallel training step (``synkhronos.extensions.train``),
   then ``synk.distribute()``;
2. the serial baseline: the same training (same initial values, same batches, same number
   of steps) in one plain PyTensor process, the master, through the same compiled graphs
   (``step.serial``), on every core of the machine, then again with one thread;
3. the same training data-parallel over all ranks, printing each epoch's loss and
   validation accuracy; validation and test accuracy are computed over the whole set by a
   synkhronos function (``num_slices`` pieces per rank, correct counts summed);
4. a summary: test accuracy, time per epoch serial vs synkhronos, speedup.

The first call of every compiled function JIT-compiles it with numba (cached on disk for
later runs).  For a CNN gradient that takes a minute or more on a cold cache; both paths are
warmed up with one step before they are timed, the first-call times are reported
separately, and the speedup compares the median epochs.  Convolutions here are window
gathers (``Im2Col``) plus one matrix product per layer: the gathers, the pooling and the
elementwise work run on one thread in a plain PyTensor process, the products on all BLAS
threads, so the ranks have something to gain even over "all cores".

Data patterns (``--data-pattern``), as in the MLP demo: ``batch`` passes the whole training
set (a ``synk.Data``) with a shuffled index array (``batch=idx``) every step; ``scatter``
scatters it once into shared variables (``synk.scatter``, declared in ``sliceable_shareds``)
and selects rows of each rank's shard with ``batch_s``.

``demos/resnet.py`` runs its ResNets through ``train_demo`` below.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits  # noqa: E402  (demos/digits.py)
from mnist_mlp import (RULE_LR, bar, check_args, common_parser, machine_busy,  # noqa: E402
                       make_epochs, usable_cores)


def int_list(text):
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return tuple(vals)


def parse_args(argv=None):
    p = common_parser(__doc__.split("\n\n")[0], epochs=15, batch_size=128)
    p.add_argument("--channels", type=int_list, default=(16, 32),
                   help="output channels of each conv stage (comma-separated)")
    p.add_argument("--hidden", type=int, default=128, help="units of the dense layer")
    a = check_args(p, p.parse_args(argv))
    if a.hidden < 1:
        p.error("--hidden must be at least 1")
    return a


# ------------------------------------------------------------------------------------------


def train_demo(args, build_model, prepare=None):
    """Serial baseline, then data-parallel training, of ``build_model(x, h, w)`` (a
    ``layers.Model``) on the digits; prints the epochs and the RESULT line and returns the
    summary as a dict.  ``prepare(data) -> data`` may transform the data set first (e.g.
    resize the images)."""
    import pytensor
    pytensor.config.floatX = "float32"
    import pytensor.tensor as pt
    from threadpoolctl import threadpool_limits

    import synkhronos as synk
    from synkhronos.extensions import train, updates

    data = digits.load(args.mnist_dir, seed=args.seed)
    if prepare is not None:
        data = prepare(data)
    X_tr, y_tr = data["train"]
    if args.train_subset is not None:
        X_tr, y_tr = X_tr[:args.train_subset], y_tr[:args.train_subset]
    X_va, y_va = data["valid"]
    X_te, y_te = data["test"]
    h, w = data["shape"]
    n_in = X_tr.shape[1]
    cores = usable_cores()

    n = synk.fork(args.n_parallel)
    try:
        B = max(n, args.batch_size - args.batch_size % n)
        b = B // n
        lr = args.learning_rate if args.learning_rate is not None else RULE_LR[args.rule]
        print(f"data: {data['name']}: {len(X_tr)} train, {len(X_va)} valid, {len(X_te)} test images")

        # ---- graphs -----------------------------------------------------------------------
        x = pt.matrix("x", dtype="float32")
        y = pt.ivector("y")
        t0 = time.perf_counter()
        model = build_model(x, h, w)
        logp = pt.special.log_softmax(model.logits, axis=-1)
        loss = pt.mean(-logp[pt.arange(y.shape[0]), y])
        logp_eval = pt.special.log_softmax(model.eval_logits, axis=-1)
        nll_eval = -logp_eval[pt.arange(y.shape[0]), y]
        n_correct = pt.sum(pt.eq(pt.argmax(logp_eval, axis=-1), y))     # int64
        print(f"model: {model.description}; {model.n_params()} parameters")
        print(f"training: {args.rule} lr={lr:g}, batch {B} ({b} per rank), {args.epochs} epoch(s), "
              f"data pattern '{args.data_pattern}'")

        base_rule = getattr(updates, args.rule)

        def rule(loss_, params_, **kw):
            # batch-norm running statistics: updated by the gradient function, in every rank,
            # from that rank's share of the batch (not synchronized; see sync_stats)
            g_upd, p_upd, g_shared = base_rule(loss_, params_, **kw)
            return g_upd + model.stat_updates, p_upd, g_shared

        if args.data_pattern == "batch":
            step = train.make_train_function(loss, model.params, [x, y], rule, learning_rate=lr)
        else:
            X_s = pytensor.shared(np.zeros((0, n_in), np.float32), name="X_train_s")
            y_s = pytensor.shared(np.zeros(0, np.int32), name="y_train_s")
            step = train.make_train_function(loss, model.params, [], rule, learning_rate=lr,
                                             givens=[(x, X_s), (y, y_s)], sliceable_shareds=[X_s, y_s])
        # sums, not averages: an int output with mode "avg" would be rounded
        f_eval = synk.function([x, y], outputs=[(n_correct, "sum"), (pt.sum(nll_eval), "sum")],
                               name="evaluate")
        t_build = time.perf_counter() - t0
        # the serial step (used below): plain PyTensor in the master, same compiled graphs
        if args.data_pattern == "batch":
            def serial_step(idx):
                return step.serial(X_tr[idx], y_tr[idx])
        else:
            def serial_step(idx):          # the scatter graph reads the (master's) shareds
                X_s.set_value(X_tr[idx], borrow=True)
                y_s.set_value(y_tr[idx], borrow=True)
                return step.serial()
        try:
            synk.distribute()
        except TypeError as e:
            if not isinstance(e.__cause__, RecursionError):
                raise
            # A known limitation (Python 3.12.1 here): pickle's C recursion limit, which
            # sys.setrecursionlimit does not raise, stops synk.distribute() from pickling a
            # graph more than about a hundred layers deep.  Run the serial baseline alone.
            print(f"synk.distribute() failed: the graph is too deep to pickle on Python "
                  f"{sys.version.split()[0]} ({e.__cause__!r}); running the serial baseline only")
            return serial_only(args, serial_step, f_eval, len(X_tr), B, X_te, y_te, cores)
        X_va_d, y_va_d = synk.data(X_va), synk.data(y_va)
        X_te_d, y_te_d = synk.data(X_te), synk.data(y_te)
        stats = model.stats

        def sync_stats():
            # one all-reduce: every rank's running statistics become their average over ranks
            if stats:
                synk.all_reduce(stats, op="avg")

        def evaluate(Xd, yd):
            sync_stats()
            c, s = f_eval(Xd, yd, num_slices=args.eval_slices)
            return float(c) / len(yd), float(s) / len(yd)

        # ---- the batches both runs use ------------------------------------------------------
        rng = np.random.default_rng(args.seed + 1)
        if args.data_pattern == "batch":
            epochs = make_epochs(rng, args.epochs, [len(X_tr)], B, args.max_steps)
            serial_idx = [[s[0] for s in ep] for ep in epochs]
        else:
            bounds = [(r * len(X_tr)) // n for r in range(n + 1)]     # synk.scatter's shards
            lengths = [bounds[r + 1] - bounds[r] for r in range(n)]
            epochs = make_epochs(rng, args.epochs, lengths, b, args.max_steps)
            serial_idx = [[np.concatenate([bounds[r] + s[r] for r in range(n)]) for s in ep]
                          for ep in epochs]
        steps = len(epochs[0])
        initial = step.snapshot()
        initial_stats = [np.array(v.get_value(), copy=True) for v in stats]

        def restore():
            step.restore(initial)                       # synk.broadcast: every rank equal
            if stats:
                synk.broadcast(stats, [v.copy() for v in initial_stats])

        busy = machine_busy()          # the ranks are idle now: this is other programs
        if busy is not None and busy > 0.1:
            print(f"note: other programs keep {100 * busy:.0f}% of the CPU busy: the timings "
                  "below are disturbed (multithreaded BLAS in the serial run suffers most)")

        # ---- 1. serial baseline -----------------------------------------------------------
        # Plain PyTensor in this (master) process: the SAME compiled graphs (step.serial /
        # Function.as_theano: no extra JIT), the same initial values and the same batches,
        # with the master's thread limit lifted to every usable core (the workers sleep
        # meanwhile), then with one thread.  Each step includes gathering the batch rows, as
        # the ranks do.  See demos/mnist_mlp.py.
        with threadpool_limits(limits=cores):
            t0 = time.perf_counter()
            serial_step(serial_idx[0][0])
            f_eval.as_theano(X_va[:2], y_va[:2])
            jit_serial = time.perf_counter() - t0
            restore()
            t_serial = []
            for e, ep_idx in enumerate(serial_idx):
                t0 = time.perf_counter()
                for idx in bar(ep_idx, args.no_progress, desc=f"serial epoch {e + 1}"):
                    serial_loss = float(serial_step(idx))
                t_serial.append(time.perf_counter() - t0)
            c_va, _ = f_eval.as_theano(X_va, y_va)
        serial_params = [p.get_value() for p in model.params]
        with threadpool_limits(limits=1):
            restore()
            t_serial1 = []
            for e, ep_idx in enumerate(serial_idx):
                t0 = time.perf_counter()
                for idx in bar(ep_idx, args.no_progress, desc=f"serial 1-thread epoch {e + 1}"):
                    serial_step(idx)
                t_serial1.append(time.perf_counter() - t0)
        time.sleep(1.0)                # let OpenBLAS's spinning threads settle (mnist_mlp.py)
        print(f"serial (1 process, {cores} threads): {steps} steps/epoch, "
              f"{np.median(t_serial):.3f} s/epoch; final loss {serial_loss:.4f}, "
              f"valid acc {int(c_va) / len(y_va):.4f}")

        # ---- 2. data-parallel -------------------------------------------------------------
        if args.data_pattern == "batch":
            X_tr_d, y_tr_d = synk.data(X_tr), synk.data(y_tr)

            def synk_step(sel):
                return step(X_tr_d, y_tr_d, batch=sel[0])
        else:
            synk.scatter([X_s, y_s], [X_tr, y_tr])
            assert synk.get_lengths(X_s) == lengths

            def synk_step(sel):
                return step(batch_s=sel)
        restore()
        t0 = time.perf_counter()
        synk_step(epochs[0][0])
        evaluate(X_va_d, y_va_d)
        jit_synk = time.perf_counter() - t0
        restore()

        print(f"synkhronos ({n} rank(s), {max(1, cores // n)} thread(s) each):")
        t_synk = []
        for e, ep in enumerate(epochs):
            losses = []
            t0 = time.perf_counter()
            pbar = bar(ep, args.no_progress, desc=f"epoch {e + 1}")
            for sel in pbar:
                losses.append(float(synk_step(sel)))
                if not args.no_progress and len(losses) % 5 == 0:
                    pbar.set_postfix(loss=f"{losses[-1]:.4f}", refresh=False)
            dt = time.perf_counter() - t0
            t_synk.append(dt)
            acc, vloss = evaluate(X_va_d, y_va_d)
            print(f"epoch {e + 1:3d}/{args.epochs}  loss {losses[0]:.4f} -> {losses[-1]:.4f} "
                  f"(mean {np.mean(losses):.4f})  valid loss {vloss:.4f}  valid acc {acc:.4f}  "
                  f"[{dt:.3f} s]", flush=True)
        test_acc, _ = evaluate(X_te_d, y_te_d)
        diff = max(float(np.max(np.abs(p.get_value() - s))) for p, s in zip(model.params, serial_params))
        why = ("float32 summation order" if not stats or n == 1 else
               "batch norm: each rank normalizes its own share of the batch, the serial run the "
               "whole batch")
        print(f"synk vs serial after {steps * args.epochs} steps: final loss {losses[-1]:.4f} vs "
              f"{serial_loss:.4f}, max |param difference| {diff:.2e} ({why})")
        s_ep, p_ep = float(np.median(t_serial)), float(np.median(t_synk))
        s1_ep = float(np.median(t_serial1))
        print(f"first call (JIT compile or cache load, excluded): serial {jit_serial:.1f} s, "
              f"synkhronos {jit_synk:.1f} s (graph build {t_build:.1f} s)")
        print(f"RESULT: test accuracy {test_acc:.4f} | time/epoch: plain PyTensor {s_ep:.3f} s "
              f"({cores} threads), {s1_ep:.3f} s (1 thread); synkhronos ({n} ranks) {p_ep:.3f} s | "
              f"speedup {s_ep / p_ep:.2f}x over PyTensor on all cores, {s1_ep / p_ep:.2f}x over "
              f"one core", flush=True)
        return dict(test_acc=test_acc, serial_epoch=s_ep, serial1_epoch=s1_ep, synk_epoch=p_ep,
                    speedup=s_ep / p_ep, speedup_1thread=s1_ep / p_ep, jit_serial=jit_serial,
                    jit_synk=jit_synk, steps=steps, batch=B, n=n)
    finally:
        synk.close()


def serial_only(args, serial_step, f_eval, n_train, B, X_te, y_te, cores):
    """The training in the master alone, as plain PyTensor (``step.serial``): for when the
    functions could not be distributed.  Prints the epochs and a RESULT line without
    synkhronos timings."""
    import time as _time
    from threadpoolctl import threadpool_limits
    rng = np.random.default_rng(args.seed + 1)
    epochs = [[s[0] for s in ep] for ep in make_epochs(rng, args.epochs, [n_train], B, args.max_steps)]
    t_ep = []
    with threadpool_limits(limits=cores):
        t0 = _time.perf_counter()
        serial_step(epochs[0][0])
        print(f"first call (JIT compile or cache load): {_time.perf_counter() - t0:.1f} s")
        for e, ep in enumerate(epochs):
            t0 = _time.perf_counter()
            losses = [float(serial_step(idx)) for idx in bar(ep, args.no_progress, desc=f"epoch {e + 1}")]
            t_ep.append(_time.perf_counter() - t0)
            print(f"epoch {e + 1:3d}/{args.epochs}  loss {losses[0]:.4f} -> {losses[-1]:.4f} "
                  f"(serial, plain PyTensor)  [{t_ep[-1]:.3f} s]", flush=True)
        c, _ = f_eval.as_theano(X_te, y_te)
    acc = int(c) / len(y_te)
    print(f"RESULT: test accuracy {acc:.4f} | time/epoch: plain PyTensor {np.median(t_ep):.3f} s "
          f"({cores} threads) | synkhronos: not run (synk.distribute() failed)", flush=True)
    return dict(test_acc=acc, serial_epoch=float(np.median(t_ep)), synk_epoch=None)


def main(argv=None):
    args = parse_args(argv)
    import layers                          # demos/layers.py (needs pytensor-ml)
    return train_demo(args, lambda x, h, w: layers.cnn(x, h, w, channels=args.channels,
                                                        hidden=args.hidden, seed=args.seed))


if __name__ == "__main__":
    main()
