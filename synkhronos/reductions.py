"""Reduction semantics, shared by function outputs (over slices and ranks) and collectives.

``avg`` is the mean weighted by how many rows each part covered (equal weights for
collectives), so it is the true mean over the whole batch even for unequal shards.  Every
reduction accumulates in ``accumulator(op, dtype)``: float16 sums and means in float32,
integer and bool means in float64, rounded to the nearest integer (half to even) and cast
back to the dtype; everything else in its own dtype."""
import operator

import numpy as np

OPS = ("avg", "sum", "prod", "max", "min")
OUTPUT_MODES = OPS + ("gather", None)
# an update's mode: combines its slices as an output's; "share" (a training step's
# gradient) is this rank's share of a mean over the whole batch, for an "avg" over ranks
UPDATE_MODES = OPS + (None, "share")
_SCALAR_OP = {"sum": operator.add, "avg": operator.add, "prod": operator.mul}
UFUNC = {"sum": np.add, "avg": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}


def check_mode(mode, allowed=OUTPUT_MODES, what="reduce mode"):
    """Validate a mode name (the original's ``c_`` prefixes are accepted and ignored)."""
    if isinstance(mode, str) and mode.startswith("c_"):
        mode = mode[2:]
    if mode not in allowed:
        raise ValueError(f"invalid {what} {mode!r}; expected one of {list(allowed)}")
    return mode


_ACC = {}


def accumulator(op, dtype):
    """The dtype in which ``op`` accumulates values of ``dtype``."""
    acc = _ACC.get((op, dtype))
    if acc is None:
        acc = _ACC[(op, dtype)] = _accumulator(op, dtype)
    return acc


def narrow_into(dst, src):
    """``src`` (an accumulator, ``accumulator``'s dtype) written into ``dst`` of the value's
    own narrower dtype: a float16 sum beyond 65504 becomes +-inf, as numpy's float16
    arithmetic makes it, without the cast's overflow warning (which a rank would print
    where the user cannot act on it; the inputs' own inf and nan pass as they are)."""
    with np.errstate(over="ignore"):
        np.copyto(dst, src, casting="unsafe")


def _accumulator(op, dtype):
    dtype = np.dtype(dtype)
    if op == "avg" and dtype.kind in "biu":
        return np.dtype(np.float64)
    if dtype == np.float16 and op in ("sum", "avg"):
        return np.dtype(np.float32)
    return dtype


def finish(op, acc, total, dtype):
    """Turn an accumulated sum into the result of ``op`` in place (``total``: the summed
    weight, or the number of ranks) and return it, still in the accumulator dtype."""
    if op != "avg":
        return acc
    if np.dtype(dtype).kind in "biu":
        np.divide(acc, total, out=acc)
        np.rint(acc, out=acc)
    else:
        acc *= acc.dtype.type(1.0 / total)
    return acc


def combine(mode, parts, weights=None):
    """Combine equally shaped arrays ``parts`` by ``mode`` into a new array.

    ``weights`` (row counts) matter only for ``avg``; ``None`` means equal weights."""
    first = np.asarray(parts[0])
    if mode == "gather":
        return np.stack(parts) if first.ndim == 0 else np.concatenate(parts, axis=0)
    if mode is None or len(parts) == 1:
        return np.array(first, copy=True)
    acc_dtype = accumulator(mode, first.dtype)
    if first.ndim == 0 and first.dtype.kind in "iuf":
        return _combine_scalars(mode, parts, weights, acc_dtype.type, first.dtype)
    if mode == "avg" and weights is not None:
        w = np.asarray(weights, dtype=np.float64)
        acc = np.multiply(first, w[0], dtype=acc_dtype)
        for p, wi in zip(parts[1:], w[1:]):
            acc += np.multiply(p, wi, dtype=acc_dtype)
        total = float(w.sum())
    else:
        fn = UFUNC[mode]
        acc = np.array(first, dtype=acc_dtype, copy=True)
        for p in parts[1:]:
            fn(acc, p, out=acc, casting="unsafe")
        total = len(parts)
    acc = np.asarray(finish(mode, np.asarray(acc), total, first.dtype))
    if acc.dtype == first.dtype:
        return acc
    out = np.empty(acc.shape, first.dtype)
    narrow_into(out, acc)
    return out


def _combine_scalars(mode, parts, weights, acc, dtype):
    """``combine`` of 0-d parts (a loss, an accuracy: most outputs) on numpy scalars, the
    same operations in the same order and dtype as on arrays, several times faster."""
    vals = []
    for p in parts:
        v = p[()] if isinstance(p, np.ndarray) else p
        vals.append(v if type(v) is acc else acc(v))
    if mode == "avg" and weights is not None:
        total = 0.0
        r = None
        for v, w in zip(vals, weights):
            w = float(w)
            total += w
            term = v * acc(w)
            r = term if r is None else r + term
    else:
        # numpy's scalar operators compute what the ufuncs compute, ~10x faster; the
        # ufuncs stay for max/min (NaN) and integers (operators warn on overflow)
        fn = _SCALAR_OP.get(mode) if issubclass(acc, np.floating) else None
        fn = fn or UFUNC[mode]
        r = vals[0]
        for v in vals[1:]:
            r = fn(r, v)
        total = len(parts)
    if mode == "avg":
        r = np.rint(r / total) if dtype.kind in "iu" else r * acc(1.0 / total)
    return np.array(r, dtype)
