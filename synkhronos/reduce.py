"""Reduce operations shared by function outputs (across slices and ranks) and collectives.

``avg`` is the mean weighted by how many rows each part covered, so it is the true mean
over the whole batch even for unequal shards.  For integer and bool dtypes ``avg`` is
computed in float64 and rounded to the nearest integer (half to even), keeping the dtype."""
import numpy as np

OUTPUT_MODES = ("avg", "sum", "prod", "max", "min", "gather", None)
REDUCE_OPS = ("avg", "sum", "prod", "max", "min")
_BINARY = {"sum": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def check_mode(mode, allowed=OUTPUT_MODES, what="reduce mode"):
    """Validate a mode name (the original's ``c_`` prefixes are accepted and ignored)."""
    if isinstance(mode, str) and mode.startswith("c_"):
        mode = mode[2:]
    if mode not in allowed:
        raise ValueError(f"invalid {what} {mode!r}; expected one of {list(allowed)}")
    return mode


def combine(mode, parts, weights=None, out=None):
    """Combine equally shaped arrays ``parts`` by ``mode``; returns a new array (or ``out``).

    ``weights`` (row counts) matter only for ``avg``; ``None`` means equal weights."""
    first = np.asarray(parts[0])
    if mode == "gather":
        return np.stack(parts) if first.ndim == 0 else np.concatenate(parts, axis=0)
    if mode is None:
        return np.array(first, copy=True)
    if len(parts) == 1 and out is None:
        return np.array(first, copy=True)
    if mode == "avg":
        w = np.ones(len(parts)) if weights is None else np.asarray(weights, dtype=np.float64)
        w = w / w.sum()
        wide = np.result_type(first.dtype, np.float64)
        acc = np.asarray(np.multiply(first, w[0], dtype=wide))
        for p, wi in zip(parts[1:], w[1:]):
            acc += np.multiply(p, wi, dtype=wide)
        if first.dtype.kind in "biu":
            acc = np.rint(acc)
        if out is None:
            return np.asarray(acc.astype(first.dtype))
        np.copyto(out, acc, casting="unsafe")
        return out
    fn = _BINARY[mode]
    if out is None:
        out = np.array(first, copy=True)
    elif out is not first:
        np.copyto(out, first)
    for p in parts[1:]:
        fn(out, p, out=out)
    return out
