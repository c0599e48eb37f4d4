"""The training harness of the demos: ``mnist_mlp.py``, ``mnist_cnn.py`` and ``resnet.py``
only define their model (and its options) and call :func:`run`.

What it does, in order:

1. the options every demo takes (``options.py``), checked before anything heavy is
   imported, so ``--help`` and bad arguments answer at once;
2. the data (``digits.py``: scikit-learn's 8x8 digits, or MNIST with ``--mnist-dir``);
   ``synk.fork()``; the model (``build_model(x, h, w)``), its softmax cross-entropy, its
   data-parallel training step (``synkhronos.extensions.train``) and an evaluation function
   (correct counts and summed losses, ``num_slices`` pieces per rank) (``training.py``);
   ``synk.distribute()``;
3. the batches (``batches.py``): per epoch, per step, per rank, the rows to use; the
   serial and the data-parallel run use exactly these;
4. the same training data-parallel over all ranks, printing each epoch's loss, validation
   accuracy and time; every three data-parallel epochs, the same epochs of the serial
   baselines (``SerialRuns``): the same training (same initial values, same batches, same
   steps) in one plain PyTensor process, the master, through the same compiled graphs
   (``step.serial``), on every core (multithreaded BLAS), then on one thread, each from
   its own state;
5. the serial runs' summary;
6. the comparison with the serial runs (final loss, largest parameter difference, and what
   explains it), the first-call (JIT) times, the load other programs put on the machine,
   and the ``RESULT:`` line: test accuracy, time per epoch serial vs synkhronos, speedups
   (``report.py``).  Progress shows on stderr meanwhile (``display.py``).

Timing.  The first call of every compiled function JIT-compiles it (numba; cached on disk
for later runs): both paths are warmed up with one step before they are timed, and the
first-call times are reported separately.  The speedups compare median epochs.  The runs
take turns because a shared machine drifts in phases of seconds while a demo epoch lasts
~0.02 s: on the 2-core VM the demos are measured on, one core's memory bandwidth moved
between 0.12 and 0.28 s for the same 60 passes over 32 MB within two minutes, and two
processes computing at once ran 1.5-1.7x slower than one in some phases
(``benchmarks/bench_machine.py``).  Run one after the other, the serial and the
data-parallel epochs were timed on different machines in effect.  Other
programs matter a lot: multithreaded BLAS, which the all-cores baseline relies on, slows
down up to ~10x when another program holds one of its cores, so the harness measures the
CPU other programs use (``synkhronos.machine_load``: ``/proc/stat`` minus this process and
its ranks) just before, during and just after the timed runs, and when they used more than
10% of the machine the ``RESULT:`` line says the speedup is unreliable and why.
"""
import os
import sys
import threading
import time

import numpy as np

from synkhronos import machine_load

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import digits  # noqa: E402  (demos/digits.py)
import report  # noqa: E402  (demos/report.py)
from batches import plan_batches  # noqa: E402
from display import Progress, busy_display, progress_mode  # noqa: E402
from options import usable_cores  # noqa: E402
from report import plural  # noqa: E402
from training import Training  # noqa: E402


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


def load_data(args, dtype, prepare=None):
    """``digits.load``'s dict, ``prepare``d, the training set cut to ``--train-subset`` and
    the images in contiguous ``dtype`` arrays."""
    data = digits.load(args.mnist_dir, seed=args.seed)
    if prepare is not None:
        data = prepare(data)
    if getattr(args, "image_size", None):
        data = digits.resize(data, args.image_size)
    X_tr, y_tr = data["train"]
    if args.train_subset is not None:
        X_tr, y_tr = X_tr[:args.train_subset], y_tr[:args.train_subset]
    (X_va, y_va), (X_te, y_te) = data["valid"], data["test"]
    X_tr, X_va, X_te = (np.ascontiguousarray(X, dtype=dtype) for X in (X_tr, X_va, X_te))
    return dict(data, train=(X_tr, y_tr), valid=(X_va, y_va), test=(X_te, y_te))


def run(args, build_model, prepare=None):
    """Serial baselines, then data-parallel training, of ``build_model(x, h, w)`` (a
    :class:`Net` or ``layers.Model`` on the float input matrix ``x`` of ``h`` x ``w``
    images) on the digits; prints the epochs, the comparison and the ``RESULT:`` line and
    returns the summary as a dict.  ``prepare(data) -> data`` may transform the data set
    first (e.g. resize the images)."""
    dtype = "float64" if args.float64 else "float32"
    import pytensor
    pytensor.config.floatX = dtype

    import synkhronos as synk

    mode = progress_mode(args.no_progress)
    data = load_data(args, dtype, prepare)
    n_train = len(data["train"][0])
    (X_va, y_va), (X_te, y_te) = data["valid"], data["test"]
    cores = usable_cores()

    n = synk.fork(args.n_parallel, timeline=args.timeline)
    try:
        info = synk.session_info()
        backend = "gpu" if info.gpu else ("jax" if "JAX" in info.device else "numba")
        B = max(n, args.batch_size - args.batch_size % n)
        print(f"data: {data['name']}: {n_train} train, {len(X_va)} valid, "
              f"{len(X_te)} test images")
        t0 = time.perf_counter()
        tr = Training(args, build_model, data, B, n, dtype)
        t_build = time.perf_counter() - t0
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
            return serial_only(args, mode, tr, n_train, B, X_te, y_te, cores)
        X_va_d, y_va_d = synk.data(X_va), synk.data(y_va)
        epochs, serial_idx, lengths = plan_batches(args.data_pattern, args.seed, args.epochs,
                                                   n_train, n, B, args.max_steps)
        steps = len(epochs[0])
        tr.remember_initial()

        s = serial_first_calls(mode, tr, serial_idx, X_va, y_va, cores)
        serial = SerialRuns(mode, serial_idx, cores, gpu=backend == "gpu", start=tr.serial_state())

        # ---- the data-parallel run, the serial runs' epochs in turn -----------------------
        synk_step = tr.feed_ranks(lengths)
        tr.restore()
        t0 = time.perf_counter()
        with busy_display("first call in the ranks (loading the compiled functions)",
                          mode != "off"):
            synk_step(epochs[0][0])
            tr.evaluate(X_va_d, y_va_d)
        jit_synk = time.perf_counter() - t0
        tr.restore()
        per_rank = max(1, cores // n)
        each = "one GPU" if backend == "gpu" else plural(per_rank, 'thread')
        print(f"synkhronos ({plural(n, 'rank')}, {each}{' each' if n > 1 else ''}), and every "
              f"{SerialRuns.TURN} epochs the same epochs of the serial "
              f"{'run' if backend == 'gpu' else 'runs'} (1 process, {serial.where()}), in turns:")
        def rebuild(n_left):                 # --elastic: a session of the ranks left
            synk.fork(n_left, timeline=args.timeline)
            tr2 = Training(args, build_model, data, B, n_left, dtype)
            synk.distribute()
            return tr2, tr2.feed_ranks(lengths), synk.data(X_va), synk.data(y_va)
        settle_threads()
        t_synk, losses, (tr, X_va_d, y_va_d) = parallel_epochs(args, mode, tr, synk_step, epochs, X_va_d, y_va_d,
                                                               rebuild if args.elastic else None,
                                                               between=serial.catch_up)
        s.update(serial.finish(tr, X_va, y_va))
        print(f"serial (1 process, {serial.where()}): {plural(steps, 'step')}/epoch, "
              f"{np.median(s['t']):.3f} s/epoch; final loss {s['loss']:.4f}, "
              f"valid acc {s['valid_acc']:.4f}")
        n = synk.session_info().n
        X_te_d, y_te_d = synk.data(X_te), synk.data(y_te)
        busy_during = s["during"].share()
        la1 = machine_load.load_average()
        busy_after = machine_load.machine_busy()
        test_acc, _ = tr.evaluate(X_te_d, y_te_d)

        # ---- the summary ------------------------------------------------------------------
        final = tr.params_now()
        diff = max(float(np.max(np.abs(p - q))) for p, q in zip(final, s["params"]))
        diff1 = max(float(np.max(np.abs(p - q))) for p, q in zip(final, s["params1"]))
        print(report.comparison(steps * args.epochs, losses[-1], s["loss"], s["loss1"], cores,
                                diff, diff1))
        print("  " + report.explain_difference(max(diff, diff1), dtype, bool(tr.stats) and n > 1,
                                               args.rule))
        s_ep, s1_ep, p_ep = (float(np.median(t)) for t in (s["t"], s["t1"], t_synk))
        print(report.first_calls(s["jit"], jit_synk, t_build))
        load_line, caveat = machine_load.load_verdict(s["busy_before"], busy_during, busy_after,
                                                      s["la0"], la1)
        print(load_line)
        print(report.result(test_acc, s_ep, s1_ep, p_ep, cores, n, caveat, backend, B), flush=True)
        return dict(test_acc=test_acc, serial_epoch=s_ep, serial1_epoch=s1_ep, synk_epoch=p_ep,
                    speedup=s_ep / p_ep, speedup_1thread=s1_ep / p_ep, jit_serial=s["jit"],
                    jit_synk=jit_synk, steps=steps, batch=B, n=n, param_diff=diff,
                    param_diff_1thread=diff1, busy=(s["busy_before"], busy_during, busy_after),
                    reliable=not caveat)
    finally:
        synk.close()


def serial_epoch(mode, tr, idx_epoch, label):
    """One epoch of a serial run (``tr.serial_step`` on each step's rows): (its time, the
    last step's loss)."""
    last = None
    t0 = time.perf_counter()
    with Progress(len(idx_epoch), label, mode) as pb:
        for idx in idx_epoch:
            last = float(tr.serial_step(idx))
            pb.step(last)
    return time.perf_counter() - t0, last


def serial_first_calls(mode, tr, serial_idx, X_va, y_va, cores):
    """The serial functions' first calls (JIT compile or cache load), on every core; then
    the other programs' load before the timed runs (the ranks idle), and an ``OtherLoad``
    started with them.  The serial runs are plain PyTensor in this (master) process, the
    SAME compiled graphs (``step.serial`` / ``Function.as_theano``: no extra JIT); they run
    after ``fork()`` only because ``synk.function`` needs a session to build the graphs."""
    from threadpoolctl import threadpool_limits
    s = {}
    with threadpool_limits(limits=cores):
        t0 = time.perf_counter()
        with busy_display("first call of the training and evaluation functions (compiling "
                          "them; numba's JIT is cached on disk for later runs)", mode != "off"):
            tr.serial_step(serial_idx[0][0])
            tr.f_eval.as_theano(X_va[:2], y_va[:2])
        s["jit"] = time.perf_counter() - t0
    tr.restore()
    s["busy_before"] = busy = machine_load.machine_busy()   # ranks idle: other programs
    if busy is not None and busy >= machine_load.BUSY:
        print(f"note: other programs keep {machine_load.percent(busy)} of the CPU busy: the "
              "timings below are disturbed (multithreaded BLAS in the serial run suffers most)")
    s["la0"] = machine_load.load_average()
    s["during"] = machine_load.OtherLoad()
    return s


class SerialRuns:
    """The serial baselines, in turns with the data-parallel run (``TURN`` epochs each): on
    every core (multithreaded BLAS), then on one thread (on a GPU: once, on the master's
    GPU), each from its own state (``Training.serial_state``: in the master only, so a
    turn never talks to the ranks), with the same batches.

    Why turns of a few epochs and not of one: the first data-parallel epoch after a pause
    took 10% longer than the next one (medians of 255 pairs: 0.0168 against 0.0153 s; its
    first step 2.3-2.5 ms against 1.3-1.4 ms, after the serial runs as after 0.1 s of
    sleep), so with turns of ``TURN`` epochs the median epoch of every run is one that
    followed one of its own.  While forked, the master's BLAS is limited to its share of
    the cores, so the limit is lifted to every usable core for the first run (the workers
    sleep on their semaphores meanwhile).  Each step includes gathering the batch rows, as
    the ranks do."""

    TURN = 3

    def __init__(self, mode, serial_idx, cores, gpu, start):
        self.mode, self.idx = mode, serial_idx
        threads = [cores] if gpu else [cores, 1]
        self.runs = [dict(threads=k, state=start, t=[], loss=None, params=None,
                          label="one GPU" if gpu else plural(k, "thread"))
                     for k in threads]

    def where(self):
        """What the serial runs use, in words."""
        return " and ".join(r["label"] for r in self.runs)

    def catch_up(self, tr, epochs_done, turn=None):
        """When the data-parallel run is ``turn`` (default ``TURN``) epochs ahead, or done:
        run each serial run's epochs up to ``epochs_done`` (never one twice: ``--elastic``
        repeats epochs, ``--resume`` starts late), print their times, put the master's
        data-parallel values back and wait for the BLAS threads to sleep."""
        from threadpoolctl import threadpool_limits
        first = min(len(r["t"]) for r in self.runs)
        ahead = epochs_done - first
        if ahead <= 0 or (ahead < (turn or self.TURN) and epochs_done < len(self.idx)):
            return
        keep = tr.serial_state()
        for run in self.runs:
            tr.set_serial_state(run["state"])
            with threadpool_limits(limits=run["threads"]):
                for e in range(len(run["t"]), epochs_done):
                    t, run["loss"] = serial_epoch(
                        self.mode, tr, self.idx[e],
                        f"serial ({run['label']}) epoch {e + 1}/{len(self.idx)}")
                    run["t"].append(t)
            run["state"], run["params"] = tr.serial_state(), tr.params_now()
        tr.set_serial_state(keep)
        which = f"epoch {epochs_done}" if ahead == 1 else f"epochs {first + 1}-{epochs_done}"
        print(f"  serial, {which}: " + "; ".join(
            f"{', '.join(f'{t:.3f}' for t in r['t'][first:])} s ({r['label']})"
            for r in self.runs), flush=True)
        settle_threads()

    def finish(self, tr, X_va, y_va):
        """The epochs not run yet, the first run's validation accuracy, and the results as
        ``run``'s ``s`` keys: ``t``, ``loss``, ``params``, ``valid_acc`` (the run on every
        core) and ``t1``, ``loss1``, ``params1`` (the one on one thread)."""
        from threadpoolctl import threadpool_limits
        self.catch_up(tr, len(self.idx), turn=1)
        first, last = self.runs[0], self.runs[-1]
        keep = tr.serial_state()
        tr.set_serial_state(first["state"])
        with threadpool_limits(limits=first["threads"]):
            c_va, _ = tr.f_eval.as_theano(X_va, y_va)
        tr.set_serial_state(keep)
        return dict(t=first["t"], loss=first["loss"], params=first["params"],
                    valid_acc=int(c_va) / len(y_va), t1=last["t"], loss1=last["loss"],
                    params1=last["params"])


def settle_threads(limit=1.0):
    """Wait (``limit`` s at most) until no other thread of this process runs: OpenBLAS's
    threads keep polling for ~0.1 s after their last job (measured here) and would take a
    core from the ranks.  Without ``/proc``, wait ``limit``."""
    task = f"/proc/{os.getpid()}/task"
    me = str(threading.get_native_id())
    end = time.perf_counter() + limit
    while time.perf_counter() < end:
        try:
            tids = [t for t in os.listdir(task) if t != me]
        except OSError:
            time.sleep(max(0.0, end - time.perf_counter()))
            return
        if not any(_thread_running(task, t) for t in tids):
            return
        time.sleep(0.005)


def _thread_running(task, tid):
    """Whether thread ``tid`` (of ``/proc/<pid>/task``) is running or runnable now."""
    try:
        with open(f"{task}/{tid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "R"
    except (OSError, IndexError):
        return False          # gone meanwhile


def parallel_epochs(args, mode, tr, synk_step, epochs, X_va_d, y_va_d, rebuild=None, between=None):
    """The data-parallel training's epochs, each followed by a validation by the ranks and
    its line (and with ``--checkpoint``, a checkpoint): (their times, the last epoch's
    losses, and ``(tr, X_va_d, y_va_d)`` of the session in use at the end).  ``--resume``
    starts after the checkpoint's epoch.  With ``rebuild(n)`` (``--elastic``) a lost rank
    does not end the run: every epoch is committed in memory, and after a loss a session
    of the ranks left (``rebuild``: fork, build, distribute) goes on from the last commit,
    with the same global batches.  ``between(tr, epochs_done)`` runs before each epoch
    (the serial runs' turn)."""
    import synkhronos as synk
    from synkhronos import checkpoint
    t_synk, losses, start = [], [float("nan")], 0
    path = os.path.join(args.checkpoint, "checkpoint.npz") if args.checkpoint else None
    if args.resume:
        state = synk.load(path)
        start = int(state["epoch"])
        print(f"resumed from {path}: {plural(start, 'epoch')} done (saved at {state['ranks']} rank(s))", flush=True)
    commit = checkpoint.snapshot({"epoch": start}) if rebuild is not None else None
    e = start
    while e < len(epochs):
        try:
            if between is not None:
                between(tr, e)
            losses = []
            t0 = time.perf_counter()
            with Progress(len(epochs[e]), f"epoch {e + 1}/{args.epochs}", mode) as pb:
                for sel in epochs[e]:
                    losses.append(float(synk_step(sel)))
                    pb.step(losses[-1])
            dt = time.perf_counter() - t0
            acc, vloss = tr.evaluate(X_va_d, y_va_d)
            if path is not None:
                os.makedirs(args.checkpoint, exist_ok=True)
                synk.save(path, state={"epoch": e + 1, "seed": args.seed, "ranks": synk.session_info().n})
            if rebuild is not None:
                commit = checkpoint.snapshot({"epoch": e + 1})
        except synk.RankLost as err:
            if rebuild is None:
                raise
            t_fail, n_left = time.perf_counter(), ranks_left(err)
            print(f"elastic: {type(err).__name__} in epoch {e + 1}: going on with {plural(n_left, 'rank')} from "
                  f"the end of epoch {commit[0]['state']['epoch']}", flush=True)
            tr, synk_step, X_va_d, y_va_d = rebuild(n_left)
            e = int(checkpoint.restore(*commit)["epoch"])
            print(f"elastic: training again {time.perf_counter() - t_fail:.1f} s after the loss (fork, build, "
                  f"distribute, restore); epoch {e + 1} again", flush=True)
            continue
        t_synk.append(dt)
        print(f"epoch {e + 1:3d}/{args.epochs}  loss {losses[0]:.4f} -> {losses[-1]:.4f} "
              f"(mean {np.mean(losses):.4f})  valid loss {vloss:.4f}  valid acc {acc:.4f}  "
              f"[{dt:.3f} s]", flush=True)
        e += 1
    if not t_synk:
        raise SystemExit(f"nothing to train: the checkpoint has all {args.epochs} epoch(s) done")
    return t_synk, losses, (tr, X_va_d, y_va_d)


def ranks_left(err):
    """The ranks left after ``err`` (a ``RankLost``) in the session it closed."""
    import synkhronos as synk
    info = synk.session_info()
    n = info.n if info is not None else 0
    return max(1, n - max(1, len(getattr(err, "ranks", ()) or ())))


def serial_only(args, mode, tr, n_train, B, X_te, y_te, cores):
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
            tr.serial_step(serial_idx[0][0])
        print(f"first call (JIT compile or cache load): {time.perf_counter() - t0:.1f} s")
        for e, ep in enumerate(serial_idx):
            t0 = time.perf_counter()
            losses = []
            with Progress(len(ep), f"epoch {e + 1}/{args.epochs}", mode) as pb:
                for idx in ep:
                    losses.append(float(tr.serial_step(idx)))
                    pb.step(losses[-1])
            t_ep.append(time.perf_counter() - t0)
            print(f"epoch {e + 1:3d}/{args.epochs}  loss {losses[0]:.4f} -> {losses[-1]:.4f} "
                  f"(serial, plain PyTensor)  [{t_ep[-1]:.3f} s]", flush=True)
        c, _ = tr.f_eval.as_theano(X_te, y_te)
    acc = int(c) / len(y_te)
    print(report.serial_result(acc, np.median(t_ep), cores), flush=True)
    return dict(test_acc=acc, serial_epoch=float(np.median(t_ep)), synk_epoch=None)
