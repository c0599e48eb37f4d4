"""Train an MLP on real handwritten digits, data-parallel over CPU worker processes.

    .venv/bin/python demos/mnist_mlp.py                      # all cores, sklearn digits
    .venv/bin/python demos/mnist_mlp.py --n-parallel 1       # master only
    .venv/bin/python demos/mnist_mlp.py --data-pattern scatter
    .venv/bin/python demos/mnist_mlp.py --mnist-dir ~/data/mnist --batch-size 1024

The model: float32, ``in -> H -> H -> 10`` (``--hidden`` H, 1024 by default), relu, softmax
cross-entropy, He-scaled uniform weights from ``--seed``.  Everything else is
``demos/harness.py``'s (shared with ``mnist_cnn.py`` and ``resnet.py``):

1. build the model and its data-parallel training step (``synkhronos.extensions.train``),
   then ``synk.distribute()``;
2. the serial baseline: the same training (same initial values, same batches, same number of
   steps) in one plain PyTensor process, the master, on every core of the machine, then on
   one thread;
3. the same training data-parallel over all ranks, printing each epoch's loss and
   validation accuracy; validation and test accuracy are computed over the whole set by a
   synkhronos function (``num_slices`` pieces per rank, correct counts summed);
4. a summary: test accuracy, time per epoch serial vs synkhronos, speedups, and a caution on
   the ``RESULT:`` line when other programs used the CPU during the timed runs.

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
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (demos/harness.py: the training run)
import options  # noqa: E402  (demos/options.py: the options every demo takes)


def parse_args(argv=None):
    p = options.make_parser(__doc__, epochs=20, batch_size=512)
    p.add_argument("--hidden", type=options.positive_int, default=1024, metavar="H",
                   help="units in each of the 2 hidden layers (default: %(default)s)")
    return options.parse(p, argv)


def build_mlp(n_in, n_hidden, n_out, seed, dtype="float32"):
    """Shared parameters (He-scaled uniform weights, zero biases) and a forward function."""
    return mlp_params([n_in, n_hidden, n_hidden, n_out], seed, dtype)


def mlp_params(sizes, seed, dtype="float32"):
    """Shared parameters of a relu MLP of layer widths ``sizes`` (He-scaled uniform
    weights, zero biases) and its forward function."""
    import pytensor
    import pytensor.tensor as pt
    rng = np.random.default_rng(seed)
    params = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        lim = np.sqrt(6.0 / (a + b)) * (np.sqrt(2.0) if i < len(sizes) - 2 else 1.0)
        params.append(pytensor.shared(rng.uniform(-lim, lim, (a, b)).astype(dtype), name=f"W{i}"))
        params.append(pytensor.shared(np.zeros(b, dtype), name=f"b{i}"))

    def forward(x):
        h = x
        for i in range(0, len(params) - 2, 2):
            h = pt.maximum(h @ params[i] + params[i + 1], 0)
        return h @ params[-2] + params[-1]
    return params, forward


def main(argv=None):
    args = parse_args(argv)

    def build(x, h, w):
        params, forward = build_mlp(h * w, args.hidden, 10, args.seed, dtype=x.dtype)
        return harness.Net(f"MLP {h * w}-{args.hidden}-{args.hidden}-10 (relu)", params,
                           forward(x))
    return harness.run(args, build)


if __name__ == "__main__":
    main()
