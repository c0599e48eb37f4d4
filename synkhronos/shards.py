"""Which rows each rank computes on: shard boundaries and call selectors.

Shards are contiguous and near-equal along axis 0 (sizes differ by at most one, the larger
ones on later ranks).  Selectors are validated here, in the master, before any worker is
involved; every error says what was expected."""
import numpy as np

from .errors import OutOfRange


def split(total, n, start=0):
    """Boundaries ``b`` (n+1 ints) so that rank r takes ``[b[r], b[r+1])`` of ``[start, start+total)``."""
    return tuple(start + (r * total) // n for r in range(n + 1))


_INT64_MAX = np.iinfo(np.int64).max


def is_int(x):
    """An integer that is not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def index_array(sel, what):
    """A 1-D int64 array from a list/tuple/array of integers, or TypeError/ValueError."""
    if isinstance(sel, (list, tuple)) and all(is_int(i) for i in sel):
        vals = [int(i) for i in sel]          # mixed numpy int types would promote to float
        if vals and max(vals) > _INT64_MAX:
            raise OutOfRange(f"{what} index {max(vals)} is out of range")
        sel = np.array(vals, dtype=np.int64)
    arr = np.asarray(sel)
    if arr.size == 0:
        arr = arr.astype(np.int64).reshape(-1) if arr.ndim <= 1 else arr
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} index list must contain integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{what} index array must be 1-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind == "u" and arr.max() > _INT64_MAX:
        raise OutOfRange(f"{what} index {arr.max()} is out of range")
    if arr.size and arr.min() < 0:
        raise OutOfRange(f"{what} has a negative index ({arr.min()}); indices must be in [0, length)")
    return np.ascontiguousarray(arr, dtype=np.int64)


def check_slice(sel, what):
    if not (is_int(sel.start) and is_int(sel.stop)):
        raise TypeError(f"{what} slice needs integer start and stop, got {sel}")
    if sel.step is not None:
        raise ValueError(f"{what} slice may not have a step, got {sel}")
    if sel.start < 0 or sel.stop < sel.start:
        raise OutOfRange(f"{what} slice must satisfy 0 <= start <= stop, got {sel}")
    return int(sel.start), int(sel.stop)


def normalize_batch(batch):
    """``batch`` -> ("range", start, stop) or ("index", int64 array) or None."""
    if batch is None:
        return None
    if is_int(batch):
        if batch < 0:
            raise OutOfRange(f"batch as an int selects the first batch rows and must be >= 0, got {batch}")
        return ("range", 0, int(batch))
    if isinstance(batch, slice):
        return ("range",) + check_slice(batch, "batch")
    if isinstance(batch, (list, tuple, np.ndarray)):
        return ("index", index_array(batch, "batch"))
    raise TypeError("batch must be an int, a slice with int start and stop, or a list, tuple or "
                    f"1-D integer array of indices; got {type(batch).__name__}")


def normalize_batch_s(batch_s, n):
    """``batch_s`` -> None, or a list of n selectors, each ("range", a, b) or ("index", arr)."""
    if batch_s is None:
        return None

    def one(sel):
        if isinstance(sel, slice):
            return ("range",) + check_slice(sel, "batch_s")
        if isinstance(sel, (list, tuple, np.ndarray)):
            return ("index", index_array(sel, "batch_s"))
        raise TypeError("batch_s entries must be slices (int start/stop) or lists/arrays of integer "
                        f"indices; got {type(sel).__name__}")

    if isinstance(batch_s, (list, tuple)) and len(batch_s) and all(
            isinstance(s, (slice, list, tuple, np.ndarray)) for s in batch_s):
        if len(batch_s) != n:
            raise ValueError(f"batch_s as a per-rank list needs one entry for each of the {n} ranks, "
                             f"got {len(batch_s)}")
        kinds = {type(s) if isinstance(s, slice) else "idx" for s in batch_s}
        if len(kinds) > 1:
            raise TypeError("batch_s per-rank entries must all be of the same kind (all slices or all index lists)")
        return [one(s) for s in batch_s]
    if isinstance(batch_s, slice) or isinstance(batch_s, (list, tuple, np.ndarray)):
        sel = one(batch_s)
        return [sel] * n
    raise TypeError("batch_s must be a slice, a list/array of indices, or a list with one of those "
                    f"per rank; got {type(batch_s).__name__}")


def sel_length(sel, full_length):
    if sel is None:
        return full_length
    return sel[2] - sel[1] if sel[0] == "range" else len(sel[1])


def sel_max(sel):
    """Largest row a selector touches plus one (0 if empty)."""
    if sel[0] == "range":
        return sel[2] if sel[2] > sel[1] else 0
    return int(sel[1].max()) + 1 if len(sel[1]) else 0


def pieces(length, num_slices):
    """Non-empty consecutive pieces ``[(a, b), …]`` of ``range(length)``: at most num_slices."""
    k = min(num_slices, length)
    if k <= 0:
        return []
    b = split(length, k)
    return [(b[i], b[i + 1]) for i in range(k)]


def take_rows(arr, rows, rank, minibatch=False, index=None):
    """Rank ``rank``'s rows of ``arr`` under ``rows`` (a ``plans.Rows``; ``index`` is its
    index array, already read): a view for ranges, a gathered copy for index lists."""
    a, b = rows.bounds[rank], rows.bounds[rank + 1]
    if minibatch:
        return arr[a - rows.base:b - rows.base] if rows.kind == "range" else arr[a:b]
    if rows.kind == "index":
        return np.take(arr, index[a:b], axis=0)
    return arr[a:b]


def select(arr, sel, index=None):
    """The rows of ``arr`` a normalized ``batch`` selector picks (``index``: its array)."""
    if sel is None:
        return arr
    if sel[0] == "range":
        return arr[sel[1]:sel[2]]
    return np.take(arr, sel[1] if index is None else index, axis=0)


def batch_rows(full, minibatch, sel):
    """How many rows ``batch`` selector ``sel`` picks from scattered inputs of lengths
    ``full`` (whole inputs) and ``minibatch`` (``Data`` holding the batch alone), checked:
    OutOfRange past the shortest whole input, ValueError for a minibatch input too short."""
    if sel[0] == "range":
        _, start, stop = sel
        if full and stop > min(full):
            raise OutOfRange(f"batch {start}:{stop} is out of range for inputs of length {min(full)}")
        total = stop - start
    else:
        idx = sel[1]
        total = len(idx)
        if full and total and idx.max() >= min(full):
            raise OutOfRange(f"batch index {idx.max()} is out of range for inputs of length {min(full)}")
    if minibatch and min(minibatch) < total:
        raise ValueError(f"minibatch inputs of lengths {minibatch} are shorter than the batch ({total} rows)")
    return total


def check_sliceable(lens, sel_s, bounds):
    """Check ``batch_s`` (per rank, or None) against every rank's lengths ``lens`` of the
    sliceable shared variables; ``bounds``: the scattered inputs' rows per rank (or None),
    which must agree.  Returns the rows each rank computes on."""
    rows_of = []
    for r in range(len(lens)):
        sel = None if sel_s is None else sel_s[r]
        if sel is None and len(set(lens[r])) > 1:
            raise ValueError(f"sliceable shareds have different lengths {lens[r]} on rank {r}; "
                             "pass batch_s or make them equal")
        top = min(lens[r])
        if sel is not None and sel_max(sel) > top:
            raise OutOfRange(f"batch_s selects row {sel_max(sel) - 1} on rank {r}, but its "
                             f"sliceable shareds have only {top} rows")
        rows_of.append(top if sel is None else sel_length(sel, top))
        if bounds is not None and bounds[r + 1] - bounds[r] != rows_of[-1]:
            raise ValueError(f"rank {r}: the scattered inputs give {bounds[r + 1] - bounds[r]} rows but the "
                             f"sliceable shareds give {rows_of[-1]}; their per-rank lengths must agree "
                             "(use batch / batch_s to select matching rows)")
    return rows_of
