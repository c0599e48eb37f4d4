"""The training harness of the demos: ``mnist_mlp.py``, ``mnist_cnn.py`` and ``resnet.py``
only define their model (and its options) and call :func:`run`.

What it does, in order:

1. the options every demo takes (:func:`make_parser`, :func:`parse`), checked before
   anything heavy is imported, so ``--help`` and bad arguments answer at once;
2. the data (``digits.py``: scikit-learn's 8x8 digits, or MNIST with ``--mnist-dir``);
   ``synk.fork()``; the model (``build_model(x, h, w)``), its softmax cross-entropy, its
   data-parallel training step (``synkhronos.extensions.train``) and an evaluation function
   (correct counts and summed losses, ``num_slices`` pieces per rank); ``synk.distribute()``;
3. the batches (:func:`make_epochs`): per epoch, per step, per rank, the rows to use; the
   serial and the data-parallel run use exactly these;
4. the serial baseline: the same training (same initial values, same batches, same steps)
   in one plain PyTensor process, the master, through the same compiled graphs
   (``step.serial``), on every core (multithreaded BLAS), then again on one thread;
5. the same training data-parallel over all ranks, printing each epoch's loss and
   validation accuracy;
6. the comparison with the serial runs (final loss, largest parameter difference, and what
   explains it), the first-call (JIT) times, the load other programs put on the machine,
   and the ``RESULT:`` line: test accuracy, time per epoch serial vs synkhronos, speedups.

Timing.  The first call of every compiled function JIT-compiles it (numba; cached on disk
for later runs): both paths are warmed up with one step before they are timed, and the
first-call times are reported separately.  The speedups compare median epochs.  Other
programs matter a lot: multithreaded BLAS, which the all-cores baseline relies on, slows
down up to ~10x when another program holds one of its cores, so the harness measures the
CPU other programs use (``/proc/stat`` minus this process and its ranks) just before,
during and just after the timed runs, and when they used more than 10% of the machine the
``RESULT:`` line says the speedup is unreliable and why.

Reproducibility.  In float32 the synkhronos run and the serial runs differ only by
rounding, but rounding is not always small in effect: a product's last bits depend on how
it is split (the batch over ranks, the columns over BLAS threads), and where that moves a
ReLU or max-pool input across its switching point, one sample's gradient through that unit
changes and the update rule (Adam's normalized steps especially) carries the difference on.
Measured on the CNN demo (default options, 150 steps): against the serial run on one thread
the ranks ended 2.2e-06 apart; against the serial run on two BLAS threads a dense-layer
ReLU flipped at step 7 (pre-activation -4.5e-07 on one thread, +2.8e-08 on two), that
step's gradient differed by 1.3e-03 in 179 entries, and the parameters ended 5.3e-02
apart (1.2e-03 after 20 steps).  With ``--seed 1`` the ranks ended 2.9e-07 from both
serial runs; with ``--seed 2``, 6.6e-03 from both (a flip caused by the batch split alone).
With ``--float64`` the same runs agree to 1.3e-15 (seed 0) and 3.3e-16 (seed 2).  Batch norm is different in kind: each rank normalizes its own share of the batch
(see ``layers.py``), so the runs are not the same training.
"""
import argparse
import contextlib
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits  # noqa: E402  (demos/digits.py)

RULE_LR = {"sgd": 0.1, "momentum": 0.05, "nesterov_momentum": 0.05, "adagrad": 0.05,
           "rmsprop": 1e-3, "adadelta": 1.0, "adam": 1e-3, "adamax": 2e-3}

BUSY = 0.10            # other programs' share of the CPU above which timings are unreliable
LINE_EVERY = 10.0      # seconds between plain progress lines (stderr not a terminal)


# ------------------------------------------------------------------------------------------
# Small helpers


def usable_cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def plural(n, word, words=None):
    """``"1 rank"``, ``"2 ranks"``."""
    return f"{n} {word if n == 1 else (words or word + 's')}"


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


def _isatty(stream):
    try:
        return bool(stream.isatty())
    except Exception:
        return False


# ------------------------------------------------------------------------------------------
# Options


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
    return p


def parse(p, argv=None):
    """Parse (values were checked by their types) and fill in the rule's learning rate."""
    a = p.parse_args(argv)
    if a.learning_rate is None:
        a.learning_rate = p.learning_rates[a.rule]
    elif not a.learning_rate > 0:
        p.error(f"--learning-rate must be positive, got {a.learning_rate}")
    return a


# ------------------------------------------------------------------------------------------
# Progress of the loops


def progress_mode(no_progress, stream=None):
    """``"off"``, ``"bar"`` (tqdm: ``stream`` is a terminal) or ``"lines"`` (plain lines)."""
    if no_progress:
        return "off"
    return "bar" if _isatty(sys.stderr if stream is None else stream) else "lines"


class Progress:
    """Progress of one loop of ``total`` steps on stderr: a tqdm bar (``mode="bar"``), a
    plain line every ``every`` seconds while the loop runs (``"lines"``: no carriage
    returns in logs and pipes), or nothing (``"off"``)."""

    def __init__(self, total, desc, mode, every=LINE_EVERY, stream=None):
        self.total, self.desc, self.mode, self.every = total, desc, mode, every
        self.stream = sys.stderr if stream is None else stream
        self.k = 0
        self.t0 = self.t_last = time.perf_counter()
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True,
                            file=self.stream)

    def step(self, loss=None):
        self.k += 1
        if self.bar is not None:
            self.bar.update(1)
            if loss is not None and self.k % 5 == 0:
                self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        elif self.mode == "lines":
            now = time.perf_counter()
            if now - self.t_last >= self.every and self.k < self.total:
                self.t_last = now
                tail = "" if loss is None else f", loss {loss:.4f}"
                try:
                    print(f"  {self.desc}: step {self.k}/{self.total}, {now - self.t0:.0f} s{tail}",
                          file=self.stream, flush=True)
                except (OSError, ValueError):
                    self.mode = "off"

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def busy_display(message, enabled):
    """``synkhronos.progress.busy`` (a line that shows a long first call is alive), or
    nothing."""
    if not enabled:
        return contextlib.nullcontext()
    from synkhronos.progress import busy
    return busy(message)


# ------------------------------------------------------------------------------------------
# Load of the machine


def _proc_stat():
    """(busy, total) CPU ticks of the whole machine since boot (Linux ``/proc/stat``)."""
    with open("/proc/stat") as f:
        v = [int(t) for t in f.readline().split()[1:9]]     # user .. steal (guest is in user)
    return sum(v) - v[3] - v[4], sum(v)


_LAUNCHERS = ("mpiexec", "mpiexec.hydra", "mpirun", "hydra_pmi_proxy", "orted", "prterun", "prted")


def _job_root(procs, me):
    """This process, or under an MPI launcher on this machine the launcher: its tree holds
    every process of the job here (with simulated hosts, the other hosts' ranks too)."""
    root, pid = me, procs.get(me, (0, 0, ""))[0]
    while pid in procs and procs[pid][2] in _LAUNCHERS:
        root, pid = pid, procs[pid][0]
    return root


def _own_ticks():
    """CPU ticks of this process and all its descendants (the ranks), or of the whole MPI
    job when an MPI launcher started it."""
    me, procs = os.getpid(), {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                s = f.read()
            rest = s[s.rindex(")") + 2:].split()
            # after the name: state ppid ... utime(11) stime(12) cutime(13) cstime(14)
            procs[int(name)] = (int(rest[1]), sum(int(t) for t in rest[11:15]), s[s.index("(") + 1:s.rindex(")")])
        except (OSError, ValueError, IndexError):
            continue                         # gone meanwhile
    kids = {}
    for pid, (ppid, _, _) in procs.items():
        kids.setdefault(ppid, []).append(pid)
    total, todo = 0, [_job_root(procs, me)]
    while todo:
        pid = todo.pop()
        if pid in procs:
            total += procs[pid][1]
        todo.extend(kids.get(pid, ()))
    return total


class OtherLoad:
    """The share of the machine's CPU (0..1, all cores) that programs other than this one and
    its ranks used between creation and :meth:`share`.  None where ``/proc`` is missing."""

    def __init__(self):
        try:
            self._start = (*_proc_stat(), _own_ticks())
        except (OSError, ValueError, IndexError):
            self._start = None

    def share(self):
        if self._start is None:
            return None
        try:
            b1, t1, o1 = (*_proc_stat(), _own_ticks())
        except (OSError, ValueError, IndexError):
            return None
        b0, t0, o0 = self._start
        if t1 <= t0:
            return None
        return min(1.0, max(0.0, ((b1 - b0) - (o1 - o0)) / (t1 - t0)))


def machine_busy(seconds=0.5):
    """Share of all cores that other programs use over ``seconds`` (this process and its
    ranks, idle meanwhile, excluded), or None where it cannot be measured."""
    m = OtherLoad()
    time.sleep(seconds)
    return m.share()


def load_average():
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _pct(x):
    return "?" if x is None else f"{100 * x:.0f}%"


def load_verdict(before, during, after, la0, la1):
    """(line describing the load, caveat for the RESULT line or "")."""
    la = "" if la0 is None or la1 is None else f"; load average {la0:.2f} -> {la1:.2f}"
    line = (f"other programs' CPU use (share of all cores): {_pct(before)} just before, "
            f"{_pct(during)} during, {_pct(after)} just after the timed runs{la}")
    known = [x for x in (before, during, after) if x is not None]
    if not known:
        return line + " (not measurable here)", ""
    worst = max(known)
    if worst < BUSY:
        return line, ""
    caveat = (f" | CAUTION: speedups unreliable: other programs used up to {_pct(worst)} of the "
              f"CPU around the timed runs ({_pct(during)} during them{la}); multithreaded BLAS, "
              f"which the all-cores baseline relies on, slows down up to ~10x when another "
              f"program holds one of its cores, so these ratios can be off several-fold either "
              f"way; rerun on an idle machine")
    return line, caveat


# ------------------------------------------------------------------------------------------
# Batches


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


def plan_batches(pattern, seed, n_epochs, n_train, n, B, max_steps):
    """``(epochs, serial_idx, lengths)``: the data-parallel run's selections per step
    (``epochs[e][k]``: one index array for ``batch``, one per rank for ``scatter``), the
    serial run's row indices into the whole training set for the same steps, and the
    ranks' shard lengths (``scatter``; None for ``batch``)."""
    rng = np.random.default_rng(seed + 1)
    if pattern == "batch":
        epochs = make_epochs(rng, n_epochs, [n_train], B, max_steps)
        return epochs, [[s[0] for s in ep] for ep in epochs], None
    bounds = [(r * n_train) // n for r in range(n + 1)]     # synk.scatter's shards
    lengths = [bounds[r + 1] - bounds[r] for r in range(n)]
    epochs = make_epochs(rng, n_epochs, lengths, B // n, max_steps)
    serial_idx = [[np.concatenate([bounds[r] + s[r] for r in range(n)]) for s in ep]
                  for ep in epochs]
    return epochs, serial_idx, lengths


# ------------------------------------------------------------------------------------------
# Models


class Net:
    """What :func:`run` needs of a model (``layers.Model`` has the same attributes):
    ``description``, ``params`` (trainable shared variables), ``logits`` (training graph),
    ``eval_logits`` (inference graph; default: ``logits``), ``stats`` (running statistics,
    e.g. batch norm's) and ``stat_updates`` (``[(stat, new value)]``, applied by the
    gradient function in every rank)."""

    def __init__(self, description, params, logits, eval_logits=None, stats=(), stat_updates=()):
        self.description, self.params, self.logits = description, list(params), logits
        self.eval_logits = logits if eval_logits is None else eval_logits
        self.stats, self.stat_updates = list(stats), list(stat_updates)


def _n_params(model):
    return int(sum(p.get_value(borrow=True).size for p in model.params))


# ------------------------------------------------------------------------------------------
# The run


def run(args, build_model, prepare=None):
    """Serial baselines, then data-parallel training, of ``build_model(x, h, w)`` (a
    :class:`Net` or ``layers.Model`` on the float input matrix ``x`` of ``h`` x ``w``
    images) on the digits; prints the epochs, the comparison and the ``RESULT:`` line and
    returns the summary as a dict.  ``prepare(data) -> data`` may transform the data set
    first (e.g. resize the images)."""
    dtype = "float64" if args.float64 else "float32"
    import pytensor
    pytensor.config.floatX = dtype
    import pytensor.tensor as pt
    from threadpoolctl import threadpool_limits

    import synkhronos as synk
    from synkhronos.extensions import train, updates

    mode = progress_mode(args.no_progress)
    data = digits.load(args.mnist_dir, seed=args.seed)
    if prepare is not None:
        data = prepare(data)
    X_tr, y_tr = data["train"]
    if args.train_subset is not None:
        X_tr, y_tr = X_tr[:args.train_subset], y_tr[:args.train_subset]
    X_va, y_va = data["valid"]
    X_te, y_te = data["test"]
    X_tr, X_va, X_te = (np.ascontiguousarray(X, dtype=dtype) for X in (X_tr, X_va, X_te))
    h, w = data["shape"]
    n_in = X_tr.shape[1]
    cores = usable_cores()

    n = synk.fork(args.n_parallel)
    try:
        B = max(n, args.batch_size - args.batch_size % n)
        b = B // n
        lr = args.learning_rate
        print(f"data: {data['name']}: {len(X_tr)} train, {len(X_va)} valid, "
              f"{len(X_te)} test images")

        # ---- graphs -----------------------------------------------------------------------
        x = pt.matrix("x", dtype=dtype)
        y = pt.ivector("y")
        t0 = time.perf_counter()
        model = build_model(x, h, w)
        stats = list(getattr(model, "stats", []))
        stat_updates = list(getattr(model, "stat_updates", []))
        eval_logits = getattr(model, "eval_logits", None)
        logp = pt.special.log_softmax(model.logits, axis=-1)
        loss = pt.mean(-logp[pt.arange(y.shape[0]), y])
        logp_eval = logp if eval_logits is None else pt.special.log_softmax(eval_logits, axis=-1)
        nll_eval = -logp_eval[pt.arange(y.shape[0]), y]
        n_correct = pt.sum(pt.eq(pt.argmax(logp_eval, axis=-1), y))     # int64
        print(f"model: {model.description}; {_n_params(model)} parameters, {dtype}")
        print(f"training: {args.rule} lr={lr:g}, batch {B} ({b} per rank), "
              f"{plural(args.epochs, 'epoch')}, data pattern '{args.data_pattern}'")

        base_rule = getattr(updates, args.rule)

        def rule(loss_, params_, **kw):
            # batch-norm running statistics: updated by the gradient function, in every rank,
            # from that rank's share of the batch (not synchronized; see sync_stats)
            g_upd, p_upd, g_shared = base_rule(loss_, params_, **kw)
            return list(g_upd) + stat_updates, p_upd, g_shared

        if args.data_pattern == "batch":
            step = train.make_train_function(loss, model.params, [x, y], rule, learning_rate=lr)
        else:
            X_s = pytensor.shared(np.zeros((0, n_in), dtype), name="X_train_s")
            y_s = pytensor.shared(np.zeros(0, np.int32), name="y_train_s")
            step = train.make_train_function(loss, model.params, [], rule, learning_rate=lr,
                                             givens=[(x, X_s), (y, y_s)],
                                             sliceable_shareds=[X_s, y_s])
        # sums, not averages: an int output with mode "avg" would be rounded
        f_eval = synk.function([x, y], outputs=[(n_correct, "sum"), (pt.sum(nll_eval), "sum")],
                               name="evaluate")
        t_build = time.perf_counter() - t0

        # the serial step: plain PyTensor in the master, the same compiled graphs
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
            return serial_only(args, mode, serial_step, f_eval, len(X_tr), B, X_te, y_te, cores)
        X_va_d, y_va_d = synk.data(X_va), synk.data(y_va)
        X_te_d, y_te_d = synk.data(X_te), synk.data(y_te)

        def sync_stats():
            # one all-reduce: every rank's running statistics become their average over ranks
            if stats:
                synk.all_reduce(stats, op="avg")

        def evaluate(Xd, yd):
            sync_stats()
            c, s = f_eval(Xd, yd, num_slices=args.eval_slices)
            return float(c) / len(yd), float(s) / len(yd)

        # ---- the batches both runs use ------------------------------------------------------
        epochs, serial_idx, lengths = plan_batches(args.data_pattern, args.seed, args.epochs,
                                                   len(X_tr), n, B, args.max_steps)
        steps = len(epochs[0])
        initial = step.snapshot()
        initial_stats = [np.array(v.get_value(), copy=True) for v in stats]

        def restore():
            step.restore(initial)                       # synk.broadcast: every rank equal
            if stats:
                synk.broadcast(stats, [v.copy() for v in initial_stats])

        def params_now():
            return [np.array(p.get_value(), copy=True) for p in model.params]

        # ---- 1. serial baselines ------------------------------------------------------------
        # Plain PyTensor in this (master) process: the SAME compiled graphs (step.serial /
        # Function.as_theano: no extra JIT), the same initial values and the same batches.
        # While forked, the master's BLAS is limited to its share of the cores, so the limit
        # is lifted to every usable core here (the workers sleep on their semaphores
        # meanwhile), then the same training runs with one thread.  It runs after fork() only
        # because synk.function needs a session to build the graphs; nothing of synkhronos
        # runs during the timed loops.  Each step includes gathering the batch rows, as the
        # ranks do.
        def serial_epochs(label):
            times, last = [], None
            for e, ep_idx in enumerate(serial_idx):
                t0 = time.perf_counter()
                with Progress(len(ep_idx), f"{label} epoch {e + 1}/{args.epochs}", mode) as pb:
                    for idx in ep_idx:
                        last = float(serial_step(idx))
                        pb.step(last)
                times.append(time.perf_counter() - t0)
            return times, last

        with threadpool_limits(limits=cores):
            t0 = time.perf_counter()
            with busy_display("first call of the training and evaluation functions (compiling "
                              "them; numba's JIT is cached on disk for later runs)",
                              mode != "off"):
                serial_step(serial_idx[0][0])
                f_eval.as_theano(X_va[:2], y_va[:2])
            jit_serial = time.perf_counter() - t0
            restore()
            busy_before = machine_busy()     # ranks idle: this is other programs
            if busy_before is not None and busy_before >= BUSY:
                print(f"note: other programs keep {_pct(busy_before)} of the CPU busy: the "
                      "timings below are disturbed (multithreaded BLAS in the serial run "
                      "suffers most)")
            la0 = load_average()
            during = OtherLoad()
            t_serial, serial_loss = serial_epochs(f"serial ({plural(cores, 'thread')})")
            c_va, _ = f_eval.as_theano(X_va, y_va)
        serial_params = params_now()
        with threadpool_limits(limits=1):
            restore()
            t_serial1, serial1_loss = serial_epochs("serial (1 thread)")
        serial1_params = params_now()
        # OpenBLAS's extra threads in this process busy-wait for a while after their last
        # job before sleeping; let them settle so they do not steal a core from the ranks.
        time.sleep(1.0)
        print(f"serial (1 process, {plural(cores, 'thread')}): {plural(steps, 'step')}/epoch, "
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
        with busy_display("first call in the ranks (loading the compiled functions)",
                          mode != "off"):
            synk_step(epochs[0][0])
            evaluate(X_va_d, y_va_d)
        jit_synk = time.perf_counter() - t0
        restore()

        per_rank = max(1, cores // n)
        print(f"synkhronos ({plural(n, 'rank')}, {plural(per_rank, 'thread')}"
              f"{' each' if n > 1 else ''}):")
        t_synk = []
        for e, ep in enumerate(epochs):
            losses = []
            t0 = time.perf_counter()
            with Progress(len(ep), f"epoch {e + 1}/{args.epochs}", mode) as pb:
                for sel in ep:
                    losses.append(float(synk_step(sel)))
                    pb.step(losses[-1])
            dt = time.perf_counter() - t0
            t_synk.append(dt)
            acc, vloss = evaluate(X_va_d, y_va_d)
            print(f"epoch {e + 1:3d}/{args.epochs}  loss {losses[0]:.4f} -> {losses[-1]:.4f} "
                  f"(mean {np.mean(losses):.4f})  valid loss {vloss:.4f}  valid acc {acc:.4f}  "
                  f"[{dt:.3f} s]", flush=True)
        busy_during = during.share()
        la1 = load_average()
        busy_after = machine_busy()
        test_acc, _ = evaluate(X_te_d, y_te_d)

        # ---- 3. summary -------------------------------------------------------------------
        final = params_now()
        diff = max(float(np.max(np.abs(p - s))) for p, s in zip(final, serial_params))
        diff1 = max(float(np.max(np.abs(p - s))) for p, s in zip(final, serial1_params))
        print(f"synk vs serial after {plural(steps * args.epochs, 'step')}: "
              f"final loss {losses[-1]:.4f} vs "
              f"{serial_loss:.4f} ({plural(cores, 'thread')}) and {serial1_loss:.4f} (1 thread); "
              f"max |param difference| {diff:.2e} and {diff1:.2e}")
        print("  " + explain_difference(max(diff, diff1), dtype, bool(stats) and n > 1, args.rule))
        s_ep, p_ep = float(np.median(t_serial)), float(np.median(t_synk))
        s1_ep = float(np.median(t_serial1))
        print(f"first call (JIT compile or cache load, excluded): serial {jit_serial:.1f} s, "
              f"synkhronos {jit_synk:.1f} s (graph build {t_build:.1f} s)")
        load_line, caveat = load_verdict(busy_before, busy_during, busy_after, la0, la1)
        print(load_line)
        print(f"RESULT: test accuracy {test_acc:.4f} | time/epoch: plain PyTensor {s_ep:.3f} s "
              f"({plural(cores, 'thread')}), {s1_ep:.3f} s (1 thread); synkhronos "
              f"({plural(n, 'rank')}) {p_ep:.3f} s | speedup {s_ep / p_ep:.2f}x over PyTensor on "
              f"all cores, {s1_ep / p_ep:.2f}x over one core{caveat}", flush=True)
        return dict(test_acc=test_acc, serial_epoch=s_ep, serial1_epoch=s1_ep, synk_epoch=p_ep,
                    speedup=s_ep / p_ep, speedup_1thread=s1_ep / p_ep, jit_serial=jit_serial,
                    jit_synk=jit_synk, steps=steps, batch=B, n=n, param_diff=diff,
                    param_diff_1thread=diff1, busy=(busy_before, busy_during, busy_after),
                    reliable=not caveat)
    finally:
        synk.close()


def explain_difference(diff, dtype, batch_norm, rule):
    """One line: why the synkhronos run's parameters differ from the serial runs' by
    ``diff`` (see the module's documentation for the measurements behind it)."""
    if batch_norm:
        return ("why: batch norm: each rank normalizes its own share of the batch, the serial "
                "runs the whole batch: not the same training, a difference is expected")
    if dtype == "float64":
        return ("why: float64 rounding only (the order of the sums differs with the batch "
                "split and the BLAS threads)")
    if diff < 1e-4:
        return ("why: float32 rounding only: the order of the sums differs with the batch "
                "split and the BLAS threads (--float64: ~1e-15)")
    return (f"why: float32 rounding: a last-bit difference (batch split, BLAS threads) moved a "
            f"ReLU or max-pool input across its switching point in some step, which changes "
            f"that sample's gradient through the unit, and {rule} carries the difference on; "
            f"with --float64 these runs agree to ~1e-15")


def serial_only(args, mode, serial_step, f_eval, n_train, B, X_te, y_te, cores):
    """The training in the master alone, as plain PyTensor (``step.serial``): for when the
    functions could not be distributed.  Prints the epochs and a RESULT line without
    synkhronos timings."""
    from threadpoolctl import threadpool_limits
    epochs, serial_idx, _ = plan_batches("batch", args.seed, args.epochs, n_train, 1, B,
                                         args.max_steps)
    t_ep = []
    with threadpool_limits(limits=cores):
        t0 = time.perf_counter()
        with busy_display("first call of the training function", mode != "off"):
            serial_step(serial_idx[0][0])
        print(f"first call (JIT compile or cache load): {time.perf_counter() - t0:.1f} s")
        for e, ep in enumerate(serial_idx):
            t0 = time.perf_counter()
            losses = []
            with Progress(len(ep), f"epoch {e + 1}/{args.epochs}", mode) as pb:
                for idx in ep:
                    losses.append(float(serial_step(idx)))
                    pb.step(losses[-1])
            t_ep.append(time.perf_counter() - t0)
            print(f"epoch {e + 1:3d}/{args.epochs}  loss {losses[0]:.4f} -> {losses[-1]:.4f} "
                  f"(serial, plain PyTensor)  [{t_ep[-1]:.3f} s]", flush=True)
        c, _ = f_eval.as_theano(X_te, y_te)
    acc = int(c) / len(y_te)
    print(f"RESULT: test accuracy {acc:.4f} | time/epoch: plain PyTensor {np.median(t_ep):.3f} s "
          f"({plural(cores, 'thread')}) | synkhronos: not run (synk.distribute() failed)",
          flush=True)
    return dict(test_acc=acc, serial_epoch=float(np.median(t_ep)), synk_epoch=None)
