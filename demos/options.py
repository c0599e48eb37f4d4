"""The command-line options every demo takes (``mnist_mlp.py``, ``mnist_cnn.py``,
``resnet.py``): :func:`make_parser` makes them, the demo adds its model's own, then
:func:`parse` reads them.  Nothing heavy is imported here, so ``--help`` and bad arguments
answer at once."""
import argparse
import os

from display import LINE_EVERY

RULE_LR = {"sgd": 0.1, "momentum": 0.05, "nesterov_momentum": 0.05, "adagrad": 0.05,
           "rmsprop": 1e-3, "adadelta": 1.0, "adam": 1e-3, "adamax": 2e-3}


def usable_cores():
    """The cores this process may run on: one rank each by default (as ``synk.fork()``
    does), and the serial baseline's BLAS threads."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def positive_int(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {v}")
    return v


def int_list(text):
    """``"16,32"`` -> ``(16, 32)`` (positive integers)."""
    try:
        vals = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return tuple(vals)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description and epilog as written; option help wrapped without breaking words
    at hyphens (``--batch-size`` stays whole)."""

    def _split_lines(self, text, width):
        import textwrap
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def make_parser(doc, *, epochs, batch_size, learning_rates=None):
    """The options every demo takes.  ``doc``: the demo's docstring (its first paragraph is
    the description, its second, the example commands, the epilog).  ``learning_rates``:
    the default step size of each update rule (default: ``RULE_LR``).  Every option's help
    states its default once; add the demo's own options, then call :func:`parse`."""
    paras = doc.strip().split("\n\n")
    epilog = "examples:\n" + paras[1] if len(paras) > 1 and paras[1].startswith("    ") else None
    p = argparse.ArgumentParser(description=paras[0], epilog=epilog,
                                formatter_class=_HelpFormatter)
    p.learning_rates = dict(RULE_LR if learning_rates is None else learning_rates)
    cores = usable_cores()
    p.add_argument("--n-parallel", type=positive_int, default=None, metavar="N",
                   help=f"number of ranks (processes); default: one per usable core "
                        f"({cores} here)")
    p.add_argument("--epochs", type=positive_int, default=epochs, metavar="N",
                   help="passes over the training set (default: %(default)s)")
    p.add_argument("--batch-size", type=positive_int, default=batch_size, metavar="ROWS",
                   help="rows per step over all ranks, rounded down to a multiple of "
                        "--n-parallel (default: %(default)s)")
    p.add_argument("--data-pattern", choices=("batch", "scatter"), default="batch",
                   help="how the ranks get their rows: 'batch' keeps the training set in a "
                        "synk.Data and passes a shuffled index array every step (batch=idx, "
                        "each rank gathers its rows); 'scatter' scatters it once into shared "
                        "variables, one shard per rank, and selects rows of each shard with "
                        "batch_s (default: %(default)s)")
    p.add_argument("--rule", choices=sorted(p.learning_rates), default="adam",
                   help="update rule of synkhronos.extensions.updates (default: %(default)s)")
    p.add_argument("--shard-updates", action="store_true",
                   help="shard the update rule's state and work over the ranks (ZeRO stage 1: "
                        "each rank keeps and updates 1/n of it; make_train_function("
                        "shard_updates=True); default: off, every rank keeps the whole state)")
    rates = ", ".join(f"{r} {v:g}" for r, v in sorted(p.learning_rates.items()))
    p.add_argument("--learning-rate", type=float, default=None, metavar="LR",
                   help=f"step size; default: per rule ({rates})")
    p.add_argument("--mnist-dir", default=None, metavar="DIR",
                   help="train on MNIST: a directory with its four idx files "
                        "(train-images-idx3-ubyte etc., optionally .gz); default: "
                        "scikit-learn's bundled 8x8 digits (no download)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the initial weights, the data split and the batch order "
                        "(default: %(default)s)")
    p.add_argument("--max-steps", type=positive_int, default=None, metavar="N",
                   help="at most N steps per epoch; default: as many as the training set "
                        "fills")
    p.add_argument("--train-subset", type=positive_int, default=None, metavar="N",
                   help="train on the first N training images only (quick runs); default: "
                        "all of them")
    p.add_argument("--eval-slices", type=positive_int, default=4, metavar="N",
                   help="num_slices of the evaluation function: pieces each rank computes "
                        "in turn for the validation and test sets (default: %(default)s)")
    p.add_argument("--float64", action="store_true",
                   help="train in float64 instead of float32 (slower; shows that the "
                        "synkhronos and serial runs differ only by float32 rounding: they then "
                        "agree to ~1e-15)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress display; by default a tqdm bar when stderr is a "
                        "terminal, otherwise a plain line every "
                        f"{LINE_EVERY:.0f} s of a long loop")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="after every epoch of the data-parallel run, save every rank's state to "
                        "DIR/checkpoint.npz (synk.save: atomic); default: none")
    p.add_argument("--resume", action="store_true",
                   help="continue the data-parallel run from DIR/checkpoint.npz (--checkpoint DIR), "
                        "at any number of ranks; the serial baseline still runs in full; default: off")
    p.add_argument("--elastic", action="store_true",
                   help="a lost worker does not end the data-parallel run: it goes on with the ranks "
                        "left from the end of the last epoch, with the same global batches "
                        "(synkhronos.checkpoint in memory; data pattern 'batch' only); default: off")
    p.add_argument("--timeline", default=None, metavar="FILE",
                   help="write a Chrome/Perfetto trace of every rank to FILE when the run ends "
                        "(synk.fork(timeline=...)); default: none")
    p.add_argument("--gpu-size", action="store_true",
                   help="a workload where a GPU pays: the images resized to 28x28 (MNIST's shape; "
                        "32x32 for --resnet50) and at least 1024 rows per step; off by default "
                        "(8x8 digits, which a GPU cannot keep busy)")
    return p


def parse(p, argv=None):
    """Parse (values were checked by their types) and fill in the rule's learning rate."""
    a = p.parse_args(argv)
    if a.elastic and a.data_pattern != "batch":
        p.error("--elastic needs --data-pattern batch (the scatter pattern's shards depend on the ranks)")
    if a.resume and not a.checkpoint:
        p.error("--resume needs --checkpoint DIR (where the checkpoint is)")
    if not hasattr(a, "image_size"):
        a.image_size = None
    if a.gpu_size:
        a.batch_size = max(a.batch_size, 1024)
        a.image_size = a.image_size or (32 if getattr(a, "resnet50", False) else 28)
    if a.learning_rate is None:
        a.learning_rate = p.learning_rates[a.rule]
    elif not a.learning_rate > 0:
        p.error(f"--learning-rate must be positive, got {a.learning_rate}")
    return a
