"""The reduction loops of the ``shm`` collectives: each rank reduces its chunk of every
rank's value, block by block while the block is in cache (float16 through
``kernels.half``: numpy's float16 casts are ~100x slower)."""
import numpy as np

from ... import reductions as red
from ...kernels import half

_TMP_BLOCK_BYTES = 1 << 18          # widened (float32/float64) accumulation blocks
_BLOCK_BYTES = 1 << 17              # in-place reduction blocks (per source), cache-resident
_ALIGN = 64                         # chunk boundaries on cache lines


_LEAN = {}      # (op, dtype) -> whether it accumulates in its own dtype (no float16 kernel)


def small_reduce(op, srcs, out):
    """Reduce ``srcs`` (rank order, shaped alike) into the new ``out``: the same values as
    ``reduce_chunk``, with less bookkeeping."""
    dtype = out.dtype
    lean = _LEAN.get((op, dtype))
    if lean is None:
        lean = _LEAN[(op, dtype)] = dtype != np.float16 and red.accumulator(op, dtype) == dtype
    if not lean:
        return reduce_chunk(op, [s.reshape(-1) for s in srcs], [out.reshape(-1)], 0, out.size, dtype)
    fn = red.UFUNC[op]
    fn(srcs[0], srcs[1], out=out)
    for x in srcs[2:]:
        fn(out, x, out=out)
    if op == "avg":
        red.finish(op, out, len(srcs), dtype)


def chunk_bounds(size, n, itemsize):
    """Chunk boundaries of ``size`` items over ``n`` ranks, on cache-line multiples."""
    q = max(1, _ALIGN // max(1, itemsize))
    nq = -(-size // q)
    b = [min(size, (r * nq // n) * q) for r in range(n + 1)]
    b[-1] = size
    return b


def row_blocks(shape, counts, n, name=None):
    """Row boundaries (n+1 ints) of the ranks' blocks of axis 0 for reduce_scatter: near-equal
    (``counts`` None) or ``counts[r]`` rows for rank r (checked here, before any wait)."""
    of = f" of {name}" if name else ""
    if len(shape) == 0:
        raise ValueError(f"reduce_scatter{of} splits along axis 0 and needs at least 1 dimension")
    if counts is None:
        return [(r * shape[0]) // n for r in range(n + 1)]
    counts = [int(c) for c in counts]
    if len(counts) != n or min(counts) < 0 or sum(counts) != shape[0]:
        raise ValueError(f"reduce_scatter{of}: counts {counts} must give each of the {n} rank(s) a "
                         f"number of rows >= 0, {shape[0]} in all")
    return [sum(counts[:r]) for r in range(n + 1)]


def _addr(a):
    return a.__array_interface__["data"][0]


def reduce_chunk(op, srcs, dsts, a, b, dtype):
    """Reduce elements [a, b) of the flat ``srcs`` (rank order) into every flat ``dsts``.

    Ops that accumulate in their own dtype write straight into the first destination
    (when that is safe: it is srcs[0], srcs[1] or no source at all) and copy the block to
    the others while it is in cache; widened ops go through a small temporary block."""
    if b <= a:
        return
    n = len(srcs)
    if n == 1:                               # one rank: the value itself
        for d in dsts:
            if _addr(d) != _addr(srcs[0]):
                np.copyto(d[a:b], srcs[0][a:b])
        return
    if dtype == np.float16:                  # numpy's float16 casts are ~100x slower: numba
        if half.reduce_chunk(op, srcs, dsts, a, b):
            return
    fn = red.UFUNC[op]
    wide = red.accumulator(op, dtype)
    d0 = None
    if wide == dtype:
        late = {_addr(s) for s in srcs[2:]}
        for i, d in enumerate(dsts):
            if _addr(d) not in late:
                d0 = d
                others = dsts[:i] + dsts[i + 1:]
                break
    if d0 is not None:
        blk = max(4096, _BLOCK_BYTES // dtype.itemsize)
        s0, s1, rest = srcs[0], srcs[1], srcs[2:]
        for s in range(a, b, blk):
            e = min(b, s + blk)
            t = d0[s:e]
            fn(s0[s:e], s1[s:e], out=t)
            for x in rest:
                fn(t, x[s:e], out=t)
            red.finish(op, t, n, dtype)
            for o in others:
                np.copyto(o[s:e], t)
        return
    blk = max(1024, _TMP_BLOCK_BYTES // wide.itemsize)
    tmp = np.empty(min(blk, b - a), wide)
    with np.errstate(over="ignore"):         # (red.narrow_into's silent cast, set once for every block)
        for s in range(a, b, blk):
            e = min(b, s + blk)
            t = tmp[:e - s]
            if wide == dtype:
                fn(srcs[0][s:e], srcs[1][s:e], out=t)
                rest = srcs[2:]
            else:
                np.copyto(t, srcs[0][s:e], casting="unsafe")
                rest = srcs[1:]
            for x in rest:
                fn(t, x[s:e], out=t, casting="unsafe")
            red.finish(op, t, n, dtype)
            for d in dsts:
                np.copyto(d[s:e], t, casting="unsafe")
