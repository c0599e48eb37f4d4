"""The batches of a demo: per epoch, per step, per rank, the rows to use.  The serial and
the data-parallel run use exactly these, so that they are the same training."""
import numpy as np


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

