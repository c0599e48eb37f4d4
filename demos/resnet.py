"""Train a ResNet on real handwritten digits, data-parallel over CPU worker processes.

    .venv/bin/python demos/resnet.py                          # small ResNet, all cores
    .venv/bin/python demos/resnet.py --n-parallel 1 --data-pattern scatter
    .venv/bin/python demos/resnet.py --width 16 --blocks 2,2  # wider and deeper
    .venv/bin/python demos/resnet.py --resnet50 --max-steps 1 --batch-size 4 --epochs 1

The original Synkhronos shipped a ResNet-50 demo; this is its CPU counterpart, with models
from ``demos/layers.py`` (pytensor-ml layers):

* default: a small ResNet sized for two CPU cores and the 8x8 digits: a 3x3 conv stem
  (``--width`` channels, 8 by default), then stages of basic residual blocks (``--blocks``,
  one block in each of two stages by default; every stage after the first halves the
  resolution and doubles the channels, through a strided 1x1 projection shortcut), global
  average pooling and a 10-way softmax; batch norm after every convolution;
* ``--resnet50``: the ResNet-50 architecture (the 7x7/2 stem and 3x3/2 max pool, bottleneck
  stages of 3, 4, 6 and 3 blocks, 2048 channels at the end; 23.5 M parameters, 10
  classes), on the digits upsampled to 32x32 (``--image-size``).  It is far too slow to
  train on a few cores, but it builds and runs with e.g.
  ``--max-steps 1 --batch-size 4 --epochs 1``.  Its functions are compiled in PyTensor's
  ``FAST_COMPILE`` mode (NumPy implementations; ``--mode`` to change): the numba JIT of
  its gradient graph did not finish within 15 minutes on a cold cache.  On Python 3.12.1,
  ``synk.distribute()`` cannot pickle a graph this deep (pickle's C recursion limit, which
  ``sys.setrecursionlimit`` does not raise; from about a hundred layers on, e.g. also
  ``--blocks 3,3``): the demo then says so and runs the serial baseline alone.

Batch normalization (see ``demos/layers.py``): in training every rank normalizes its own
share of the batch with that share's statistics, as PyTorch's DistributedDataParallel does
without SyncBatchNorm; the running mean and variance are updated by the gradient
function in every rank from its own share and are *not* synchronized by the training
step; before each evaluation they are averaged over the ranks with one
``synk.all_reduce``, and evaluation normalizes with them.  So the data-parallel training
is not step-for-step the serial one (which normalizes whole batches): the demo reports
the difference and does not expect it to be small.

Everything else (the serial baselines on all cores and on one thread through the same
compiled graphs, the data patterns ``--data-pattern batch|scatter``, validation and test
with ``num_slices``, the comparison and the RESULT line) is ``demos/harness.py``'s, shared
with ``mnist_mlp.py`` and ``mnist_cnn.py``.
"""
import os
import sys


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  (demos/harness.py: the training run)
import options  # noqa: E402  (demos/options.py: the options every demo takes)

# batch norm trains well at a larger step than the MLP's Adam 1e-3
LEARNING_RATES = {**options.RULE_LR, "adam": 3e-3}


def parse_args(argv=None):
    p = options.make_parser(__doc__, epochs=15, batch_size=128, learning_rates=LEARNING_RATES)
    p.add_argument("--width", type=options.positive_int, default=8, metavar="C",
                   help="channels of the stem and the first stage; each later stage doubles "
                        "them (default: %(default)s)")
    p.add_argument("--blocks", type=options.int_list, default=(1, 1), metavar="N1,N2,...",
                   help="basic blocks per stage, comma-separated; one stage per entry "
                        "(default: 1,1)")
    p.add_argument("--resnet50", action="store_true",
                   help="build the ResNet-50 architecture instead of the small ResNet (very "
                        "slow on CPUs: try --max-steps 1 --batch-size 4 --epochs 1)")
    p.add_argument("--image-size", type=int, default=None, metavar="PIXELS",
                   help="resize the images to PIXELS x PIXELS (bilinear); default: unchanged "
                        "(8x8 digits) for the small ResNet, 32 for --resnet50")
    p.add_argument("--mode", default=None, metavar="MODE",
                   help="PyTensor compile mode: NUMBA (numba JIT) or FAST_COMPILE (NumPy "
                        "implementations, no JIT); default: PyTensor's own (NUMBA) for the "
                        "small ResNet, FAST_COMPILE for --resnet50")
    a = options.parse(p, argv)
    if a.mode is None:
        a.mode = "FAST_COMPILE" if a.resnet50 else None
    if a.image_size is None and a.resnet50:
        a.image_size = 32
    if a.image_size is not None and a.image_size < 4:
        p.error("--image-size must be at least 4")
    return a


def main(argv=None):
    args = parse_args(argv)
    if args.mode is not None:
        import pytensor
        pytensor.config.mode = args.mode     # before any function is compiled
        print(f"PyTensor mode: {args.mode}")
    import layers                          # demos/layers.py (needs pytensor-ml)
    if args.resnet50:
        def build(x, h, w):
            return layers.resnet50(x, h, w, seed=args.seed)
    else:
        def build(x, h, w):
            return layers.resnet(x, h, w, width=args.width, blocks=args.blocks, seed=args.seed)
    return harness.run(args, build)


if __name__ == "__main__":
    main()
