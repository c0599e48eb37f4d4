"""The wording of a demo's summary: how the data-parallel run compares with the serial runs,
why their parameters differ, the first-call times and the ``RESULT:`` line.

Reproducibility.  In float32 the synkhronos run and the serial runs differ only by
rounding, but rounding is not always small in effect: a product's last bits depend on how
it is split (the batch over ranks, the columns over BLAS threads), and where that moves a
ReLU or max-pool input across its switching point, one sample's gradient through that unit
changes and the update rule (Adam's normalized steps especially) carries the difference on.
Measured on the CNN demo (default options, 150 steps), in an earlier build: against the
serial run on one thread the ranks ended 2.2e-06 apart; against the serial run on two BLAS
threads a dense-layer ReLU flipped at step 7 (pre-activation -4.5e-07 on one thread,
+2.8e-08 on two), that step's gradient differed by 1.3e-03 in 179 entries, and the
parameters ended 5.3e-02 apart (1.2e-03 after 20 steps).  On 2026-11-28 both serial runs
ended at the same loss (0.0926) and the ranks 5.3e-02 from both (the batch split alone
moved a switching point; ``--float64``: 6.9e-16).  With ``--seed 1`` the ranks ended 2.9e-07 from both
serial runs; with ``--seed 2``, 6.6e-03 from both (a flip caused by the batch split alone).
With ``--float64`` the same runs agree to 1.3e-15 (seed 0) and 3.3e-16 (seed 2).  Batch
norm is different in kind: each rank normalizes its own share of the batch (see
``layers.py``), so the runs are not the same training.
"""


def plural(n, word, words=None):
    """``"1 rank"``, ``"2 ranks"``."""
    return f"{n} {word if n == 1 else (words or word + 's')}"


def comparison(steps, loss, serial_loss, serial1_loss, cores, diff, diff1):
    """The final losses and the largest parameter differences of the data-parallel run
    against the serial runs on all cores and on one thread."""
    return (f"synk vs serial after {plural(steps, 'step')}: final loss {loss:.4f} vs "
            f"{serial_loss:.4f} ({plural(cores, 'thread')}) and {serial1_loss:.4f} (1 thread); "
            f"max |param difference| {diff:.2e} and {diff1:.2e}")


def explain_difference(diff, dtype, batch_norm, rule):
    """One line: why the synkhronos run's parameters differ from the serial runs' by
    ``diff`` (see "Reproducibility" above for the measurements behind it)."""
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




def first_calls(jit_serial, jit_synk, t_build):
    """The first-call (JIT compile or cache load) times, which the epochs exclude."""
    return (f"first call (JIT compile or cache load, excluded): serial {jit_serial:.1f} s, "
            f"synkhronos {jit_synk:.1f} s (graph build {t_build:.1f} s)")


def result(test_acc, s_ep, s1_ep, p_ep, cores, n, caveat, backend="numba", batch=None):
    """The ``RESULT:`` line: test accuracy, median epoch of the serial runs (all cores, one
    thread) and of the data-parallel run, the speedups, what they compare (``batch`` rows a
    step, split over the ranks; one thread a rank), a note when the one-thread serial run
    was the faster one, and ``caveat`` (the load's).  On GPU
    ranks (``backend="gpu"``) the serial run is plain PyTensor JAX on one GPU; on JAX CPU
    ranks (``"jax"``) plain PyTensor JAX on the cores."""
    if backend != "gpu" and cores > 1 and s1_ep < s_ep:
        caveat = (f" | note: plain PyTensor ran faster on one thread than on {cores} in this run (its "
                  f"threads cost more than they gave on these steps): the figure over one core is the "
                  f"one to read{caveat}")
    if batch:
        what = f" (batch {batch}: {batch // n} rows a rank" + ("" if backend == "gpu" else ", 1 thread each") + ")"
        caveat = what + caveat
    if backend == "gpu":
        return (f"RESULT: test accuracy {test_acc:.4f} | time/epoch: plain PyTensor JAX {s_ep:.3f} s "
                f"(one GPU); synkhronos ({plural(n, 'GPU rank')}) {p_ep:.3f} s | speedup {s_ep / p_ep:.2f}x "
                f"over plain PyTensor JAX on one GPU{caveat}")
    return (f"{_result_start(test_acc, s_ep, cores, backend)}, {s1_ep:.3f} s (1 thread); synkhronos "
            f"({plural(n, 'rank')}) {p_ep:.3f} s | speedup {s_ep / p_ep:.2f}x over PyTensor on "
            f"all cores, {s1_ep / p_ep:.2f}x over one core{caveat}")


def serial_result(test_acc, s_ep, cores):
    """The ``RESULT:`` line of a serial run alone (``synk.distribute()`` failed)."""
    return f"{_result_start(test_acc, s_ep, cores)} | synkhronos: not run (synk.distribute() failed)"


def _result_start(test_acc, s_ep, cores, backend="numba"):
    """Where every ``RESULT:`` line starts: the test accuracy and the median epoch of the
    serial run on all cores."""
    jax = " JAX" if backend == "jax" else ""
    return (f"RESULT: test accuracy {test_acc:.4f} | time/epoch: plain PyTensor{jax} {s_ep:.3f} s "
            f"({plural(cores, 'thread')})")
