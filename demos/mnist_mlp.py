"""Train an MLP on real handwritten digits, data-parallel over CPU worker processes.

    .venv/bin/python demos/mnist_mlp.py                      # all cores, sklearn digits
    .venv/bin/python demos/mnist_mlp.py --n-parallel 1       # master only
    .venv/bin/python demos/mnist_mlp.py --data-pattern scatter
    .venv/bin/python demos/mnist_mlp.py --mnist-dir ~/data/mnist --batch-size 1024

The run, in order:

1. build the model (float32, ``in -> H -> H -> 10``, relu, softmax cross-entropy) and its
   data-parallel training step (``synkhronos.extensions.train``), then ``synk.distribute()``;
2. the serial baseline: the same training (same initial values, same batches, same number of
   steps) in one plain PyTensor process, the master, on every core of the machine;
3. the same training data-parallel over all ranks, printing each epoch's loss and
   validation accuracy; validation and test accuracy are computed over the whole set by a
   synkhronos function (``num_slices`` pieces per rank, correct counts summed);
4. a summary: test accuracy, time per epoch serial vs synkhronos, speedup.

The first call of every compiled function JIT-compiles it (numba; cached on disk for later
runs).  Both paths are warmed up with one step before they are timed, so the speedup
compares steady-state epochs (the median epoch of each run, which other programs briefly
taking a core disturb least); the first-call times are reported separately.  The serial
baseline is plain PyTensor with multithreaded BLAS on every core: for a GEMM-bound model
BLAS threads already keep the cores busy, so expect speedups near 1x on few cores; the
ranks gain where the serial graph is not multithreaded (elementwise work, small matrices).

Data patterns (``--data-pattern``):

* ``batch``: the training set lives in ``synk.Data`` (shared memory); every step passes the
  whole Data with a shuffled index array (``batch=idx``) and each rank gathers its own
  rows;
* ``scatter``: the training set is scattered once into shared variables (``synk.scatter``),
  one shard per rank; every step selects rows of each rank's shard with ``batch_s`` (one
  shuffled index array per rank); the variables are declared in ``sliceable_shareds``.
"""
import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits  # noqa: E402  (demos/digits.py)

RULE_LR = {"sgd": 0.1, "momentum": 0.05, "nesterov_momentum": 0.05, "adagrad": 0.05,
           "rmsprop": 1e-3, "adadelta": 1.0, "adam": 1e-3, "adamax": 2e-3}


def usable_cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def common_parser(description, epochs, batch_size):
    """The options every demo of this family takes (those of ``demos/mnist_mlp.py``)."""
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--n-parallel", type=int, default=None,
                   help="number of ranks (processes); default: all usable cores")
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--batch-size", type=int, default=batch_size,
                   help="rows per step over all ranks (rounded down to a multiple of n-parallel)")
    p.add_argument("--data-pattern", choices=("batch", "scatter"), default="batch")
    p.add_argument("--rule", choices=sorted(RULE_LR), default="adam", help="update rule")
    p.add_argument("--learning-rate", type=float, default=None,
                   help="default: a sensible value for the rule")
    p.add_argument("--mnist-dir", default=None,
                   help="directory with the MNIST idx files (default: scikit-learn's bundled digits)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=None, help="at most this many steps per epoch")
    p.add_argument("--train-subset", type=int, default=None,
                   help="use only the first N training images (quick runs)")
    p.add_argument("--eval-slices", type=int, default=4,
                   help="num_slices for validation/test: pieces each rank computes in turn")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    return p


def check_args(p, a):
    for name in ("epochs", "batch_size", "eval_slices"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("max_steps", "train_subset"):
        if getattr(a, name) is not None and getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if a.n_parallel is not None and a.n_parallel < 1:
        p.error("--n-parallel must be at least 1")
    return a


def parse_args(argv=None):
    p = common_parser(__doc__.split("\n\n")[0], epochs=20, batch_size=512)
    p.add_argument("--hidden", type=int, default=1024, help="units in each of the 2 hidden layers")
    a = check_args(p, p.parse_args(argv))
    if a.hidden < 1:
        p.error("--hidden must be at least 1")
    return a


# ------------------------------------------------------------------------------------------
# Model


def build_mlp(n_in, n_hidden, n_out, seed):
    """Shared float32 parameters (He-scaled uniform weights, zero biases) and a forward fn."""
    import pytensor
    import pytensor.tensor as pt
    rng = np.random.default_rng(seed)
    sizes = [n_in, n_hidden, n_hidden, n_out]
    params = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        lim = np.sqrt(6.0 / (a + b)) * (np.sqrt(2.0) if i < len(sizes) - 2 else 1.0)
        params.append(pytensor.shared(rng.uniform(-lim, lim, (a, b)).astype(np.float32), name=f"W{i}"))
        params.append(pytensor.shared(np.zeros(b, np.float32), name=f"b{i}"))

    def forward(x):
        h = x
        for i in range(0, len(params) - 2, 2):
            h = pt.maximum(h @ params[i] + params[i + 1], 0)
        return h @ params[-2] + params[-1]
    return params, forward


def make_epochs(rng, n_epochs, lengths, rows_per_rank, max_steps):
    """Per epoch, per step, per rank: index arrays into each rank's part of the training set.

    ``lengths`` are the parts' sizes (one part for the batch pattern: the whole set).  Both
    the serial and the parallel run use exactly these batches."""
    steps = min(lengths) // rows_per_rank
    if max_steps is not None:
        steps = min(steps, max_steps)
    if steps < 1:
        raise SystemExit(f"a batch needs {rows_per_rank} rows per part but a part has only "
                         f"{min(lengths)}: use a smaller --batch-size")
    epochs = []
    for _ in range(n_epochs):
        perms = [rng.permutation(n) for n in lengths]
        epochs.append([[perm[k * rows_per_rank:(k + 1) * rows_per_rank] for perm in perms]
                       for k in range(steps)])
    return epochs


def machine_busy(seconds=0.5):
    """Fraction of all cores busy over ``seconds`` (Linux /proc/stat), or None."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(t) for t in f.readline().split()[1:]]
        return sum(v) - v[3] - v[4], sum(v)
    try:
        b0, t0 = sample()
        time.sleep(seconds)
        b1, t1 = sample()
        return (b1 - b0) / max(1, t1 - t0)
    except (OSError, ValueError, IndexError):
        return None


def bar(it, disable, **kw):
    from tqdm import tqdm
    return tqdm(it, disable=disable, leave=False, dynamic_ncols=True, file=sys.stderr, **kw)


# ------------------------------------------------------------------------------------------


def main(argv=None):
    args = parse_args(argv)
    import pytensor
    pytensor.config.floatX = "float32"
    import pytensor.tensor as pt
    from threadpoolctl import threadpool_limits

    import synkhronos as synk
    from synkhronos.extensions import train, updates

    data = digits.load(args.mnist_dir, seed=args.seed)
    X_tr, y_tr = data["train"]
    if args.train_subset is not None:
        X_tr, y_tr = X_tr[:args.train_subset], y_tr[:args.train_subset]
    X_va, y_va = data["valid"]
    X_te, y_te = data["test"]
    n_in = X_tr.shape[1]
    cores = usable_cores()

    n = synk.fork(args.n_parallel)
    try:
        B = max(n, args.batch_size - args.batch_size % n)
        b = B // n
        lr = args.learning_rate if args.learning_rate is not None else RULE_LR[args.rule]
        print(f"data: {data['name']}: {len(X_tr)} train, {len(X_va)} valid, {len(X_te)} test images")
        print(f"model: MLP {n_in}-{args.hidden}-{args.hidden}-10 (relu), {args.rule} lr={lr:g}, "
              f"batch {B} ({b} per rank), {args.epochs} epoch(s), data pattern '{args.data_pattern}'")

        # ---- graphs -----------------------------------------------------------------------
        x = pt.matrix("x", dtype="float32")
        y = pt.ivector("y")
        params, forward = build_mlp(n_in, args.hidden, 10, args.seed)
        logp = pt.special.log_softmax(forward(x), axis=-1)
        nll = -logp[pt.arange(y.shape[0]), y]
        loss = pt.mean(nll)
        n_correct = pt.sum(pt.eq(pt.argmax(logp, axis=-1), y))     # int64
        rule = getattr(updates, args.rule)
        if args.data_pattern == "batch":
            step = train.make_train_function(loss, params, [x, y], rule, learning_rate=lr)
        else:
            X_s = pytensor.shared(np.zeros((0, n_in), np.float32), name="X_train_s")
            y_s = pytensor.shared(np.zeros(0, np.int32), name="y_train_s")
            step = train.make_train_function(loss, params, [], rule, learning_rate=lr,
                                             givens=[(x, X_s), (y, y_s)], sliceable_shareds=[X_s, y_s])
        # sums, not averages: an int output with mode "avg" would be rounded
        f_eval = synk.function([x, y], outputs=[(n_correct, "sum"), (pt.sum(nll), "sum")], name="evaluate")
        synk.distribute()
        X_va_d, y_va_d = synk.data(X_va), synk.data(y_va)
        X_te_d, y_te_d = synk.data(X_te), synk.data(y_te)

        def evaluate(Xd, yd):
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
        busy = machine_busy()          # the ranks are idle now: this is other programs
        if busy is not None and busy > 0.1:
            print(f"note: other programs keep {100 * busy:.0f}% of the CPU busy: the timings "
                  "below are disturbed (multithreaded BLAS in the serial run suffers most)")

        # ---- 1. serial baseline -----------------------------------------------------------
        # The serial baseline runs in this (master) process with plain PyTensor: the SAME
        # compiled graphs (step.serial / Function.as_theano: no extra JIT), the same initial
        # values and the same batches.  While forked, the master's BLAS is limited to its
        # share of the cores, so we lift the limit to every usable core here; the workers sit
        # idle (asleep on their semaphores) meanwhile.  It runs after fork() only because
        # synk.function needs a forked session to build the graphs; nothing of synkhronos
        # runs during the timed loop.  Each step includes gathering the batch rows, as the
        # ranks do.
        if args.data_pattern == "batch":
            def serial_step(idx):
                return step.serial(X_tr[idx], y_tr[idx])
        else:
            def serial_step(idx):          # the scatter graph reads the (master's) shareds
                X_s.set_value(X_tr[idx], borrow=True)
                y_s.set_value(y_tr[idx], borrow=True)
                return step.serial()
        with threadpool_limits(limits=cores):
            t0 = time.perf_counter()
            serial_step(serial_idx[0][0])
            f_eval.as_theano(X_va[:2], y_va[:2])
            jit_serial = time.perf_counter() - t0
            step.restore(initial)
            t_serial = []
            for e, ep_idx in enumerate(serial_idx):
                t0 = time.perf_counter()
                for idx in bar(ep_idx, args.no_progress, desc=f"serial epoch {e + 1}"):
                    serial_loss = float(serial_step(idx))
                t_serial.append(time.perf_counter() - t0)
            c_va, _ = f_eval.as_theano(X_va, y_va)
        # the same serial training with one BLAS thread: what one core does alone
        serial_params = [p.get_value() for p in params]
        with threadpool_limits(limits=1):
            step.restore(initial)
            t_serial1 = []
            for e, ep_idx in enumerate(serial_idx):
                t0 = time.perf_counter()
                for idx in bar(ep_idx, args.no_progress, desc=f"serial 1-thread epoch {e + 1}"):
                    serial_step(idx)
                t_serial1.append(time.perf_counter() - t0)
        # OpenBLAS's extra threads in this process busy-wait for a while after their last
        # job before sleeping; let them settle so they do not steal a core from the ranks.
        time.sleep(1.0)
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
        step.restore(initial)                    # synk.broadcast: every rank starts equal
        t0 = time.perf_counter()
        synk_step(epochs[0][0])
        evaluate(X_va_d, y_va_d)
        jit_synk = time.perf_counter() - t0
        step.restore(initial)

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
        diff = max(float(np.max(np.abs(p.get_value() - s))) for p, s in zip(params, serial_params))
        print(f"synk vs serial after {steps * args.epochs} steps: final loss {losses[-1]:.4f} vs "
              f"{serial_loss:.4f}, max |param difference| {diff:.2e} (float32 summation order)")
        # median over epochs: robust to other programs briefly taking a core
        s_ep, p_ep = float(np.median(t_serial)), float(np.median(t_synk))
        s1_ep = float(np.median(t_serial1))
        print(f"first call (JIT compile or cache load, excluded): serial {jit_serial:.1f} s, "
              f"synkhronos {jit_synk:.1f} s")
        print(f"RESULT: test accuracy {test_acc:.4f} | time/epoch: plain PyTensor {s_ep:.3f} s "
              f"({cores} threads), {s1_ep:.3f} s (1 thread); synkhronos ({n} ranks) {p_ep:.3f} s | "
              f"speedup {s_ep / p_ep:.2f}x over PyTensor on all cores, {s1_ep / p_ep:.2f}x over "
              f"one core", flush=True)
        return dict(test_acc=test_acc, serial_epoch=s_ep, serial1_epoch=s1_ep, synk_epoch=p_ep,
                    speedup=s_ep / p_ep, speedup_1thread=s1_ep / p_ep)
    finally:
        synk.close()


if __name__ == "__main__":
    main()
