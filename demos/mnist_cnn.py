"""Train a small CNN on real handwritten digits, data-parallel over CPU worker processes.

    .venv/bin/python demos/mnist_cnn.py                      # all cores, sklearn digits
    .venv/bin/python demos/mnist_cnn.py --n-parallel 1       # master only
    .venv/bin/python demos/mnist_cnn.py --data-pattern scatter
    .venv/bin/python demos/mnist_cnn.py --mnist-dir ~/data/mnist --batch-size 256

The model (``demos/layers.py``, built from pytensor-ml layers): two stages of 3x3
convolution (``--channels``, 16 and 32 by default, "same" padding), relu and 2x2 max
pooling, then a dense relu layer (``--hidden``) and a 10-way softmax; float32.  The run is
``demos/harness.py``'s, as for the MLP demo: the serial baselines (plain PyTensor through
the same compiled graphs, on every core, then on one thread), the data-parallel training
with each epoch's validation accuracy, the comparison with the serial runs, and the
``RESULT:`` line.

The first call of every compiled function JIT-compiles it with numba (cached on disk for
later runs).  For a CNN gradient that takes a minute or more on a cold cache; both paths are
warmed up with one step before they are timed, the first-call times are reported
separately, and the speedup compares the median epochs.  Convolutions here are window
gathers (``Im2Col``) plus one matrix product per layer: the gathers, the pooling and the
elementwise work run on one thread in a plain PyTensor process, the products on all BLAS
threads, so the ranks have something to gain even over "all cores".

The comparison with the serial runs: without batch norm the runs are the same training, up
to float32 rounding.  That rounding differs with the batch split and the number of BLAS
threads, and where it moves a ReLU or max-pool input across its switching point Adam
carries the difference on: with the default options the ranks ended 5.3e-02 from both
serial runs on 2026-11-28 (2.2e-06 from the one-thread run in an earlier build, where a
two-thread ReLU flipped at step 7); with ``--float64`` all of them agree to ~1e-15 (see
``demos/report.py``).

Data patterns (``--data-pattern``), as in the MLP demo: ``batch`` passes the whole training
set (a ``synk.Data``) with a shuffled index array (``batch=idx``) every step; ``scatter``
scatters it once into shared variables (``synk.scatter``, declared in ``sliceable_shareds``)
and selects rows of each rank's shard with ``batch_s``.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (demos/harness.py: the training run)
import options  # noqa: E402  (demos/options.py: the options every demo takes)


def parse_args(argv=None):
    p = options.make_parser(__doc__, epochs=15, batch_size=128)
    p.add_argument("--channels", type=options.int_list, default=(16, 32), metavar="C1,C2,...",
                   help="output channels of each conv stage, comma-separated; one stage per "
                        "entry (default: 16,32)")
    p.add_argument("--hidden", type=options.positive_int, default=128, metavar="H",
                   help="units of the dense layer (default: %(default)s)")
    return options.parse(p, argv)


def main(argv=None):
    args = parse_args(argv)
    import layers                          # demos/layers.py (needs pytensor-ml)
    return harness.run(args, lambda x, h, w: layers.cnn(x, h, w, channels=args.channels,
                                                         hidden=args.hidden, seed=args.seed))


if __name__ == "__main__":
    main()
