"""The numba kernels of ``synkhronos.kernels.half`` (see there), on float16 bit patterns.

A module of its own so that importing numba (~0.3 s a process) and loading the compiled
kernels from numba's cache happen at their first use, not in every rank that starts: JAX
ranks and sessions without float16 values never pay it."""
import numpy as np
from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def _f2u(typingctx, x):
    """The bits of a float32, as a uint32 (no conversion)."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.uint32))
    return sig, codegen


@intrinsic
def _u2f(typingctx, x):
    """The float32 whose bits are this uint32."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))
    return sig, codegen


@njit(inline="always", cache=True)
def _to_half(x):
    """float32 -> float16 bits, round to nearest even (numpy's cast)."""
    u = _f2u(x)
    sign = (u >> np.uint32(16)) & np.uint32(0x8000)
    a = u & np.uint32(0x7fffffff)
    if a >= np.uint32(0x47800000):                  # |x| >= 65536, inf, nan
        h = np.uint32(0x7e00) if a > np.uint32(0x7f800000) else np.uint32(0x7c00)
    elif a < np.uint32(0x38800000):                 # |x| < 2**-14: subnormal or zero
        h = np.uint32(np.rint(_u2f(a) * np.float32(16777216.0)))
    else:                                           # normal (may round up to inf)
        odd = (a >> np.uint32(13)) & np.uint32(1)
        h = (a + np.uint32(0xc8000fff) + odd) >> np.uint32(13)
    return np.uint16(h | sign)


@njit(inline="always", cache=True)
def _to_single(h):
    """float16 bits -> float32 (exact)."""
    h = np.uint32(h)
    o = (h & np.uint32(0x7fff)) << np.uint32(13)
    e = o & np.uint32(0x0f800000)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    if e == np.uint32(0x0f800000):                  # inf, nan
        return _u2f((o + np.uint32(0x70000000)) | sign)
    if e == 0:                                      # zero, subnormal
        v = np.float32(h & np.uint32(0x3ff)) * np.float32(5.9604644775390625e-08)
        return _u2f(_f2u(v) | sign)
    return _u2f((o + np.uint32(0x38000000)) | sign)


@njit(inline="always", cache=True)
def _saturated(x):
    """float16 bits of ``x``, finite values beyond the range clamped to +-65504."""
    h = _to_half(x)
    if (h & np.uint16(0x7fff)) == np.uint16(0x7c00) and np.isfinite(x):
        h = (h & np.uint16(0x8000)) | np.uint16(0x7bff)
    return h


@njit(cache=True)
def compress(src, dst, scale):
    for i in range(src.size):
        dst[i] = _saturated(src[i] * scale)


@njit(cache=True)
def compress_ef(src, res_in, dst, res_out, scale):
    unscale = np.float32(1.0) / scale                # (powers of two: both products exact)
    for i in range(src.size):
        x = src[i] + res_in[i]
        h = _saturated(x * scale)
        dst[i] = h
        if np.isfinite(x):
            res_out[i] = x - _to_single(h) * unscale
        else:
            res_out[i] = np.float32(0.0)


@njit(cache=True)
def decompress(src, dst, unscale):
    for i in range(src.size):
        dst[i] = _to_single(src[i]) * unscale


@njit(cache=True)
def finite_max(src, res, with_res):
    top = np.float32(0.0)
    for i in range(src.size):
        x = src[i] + res[i] if with_res else src[i]
        if np.isfinite(x):
            a = abs(x)
            if a > top:
                top = a
    return top


_BLOCK = 8192                                       # elements: 32 KB of float32


@njit(cache=True)
def sum_blocks(srcs, dsts, a, b, scale, do_scale):
    # blockwise (the block stays in cache), one loop per source; numba's slice
    # assignment and indexing with an offset are several times slower than loops
    # over views
    n = len(srcs)
    acc = np.empty(_BLOCK, np.float32)
    out = np.empty(_BLOCK, np.uint16)
    for s in range(a, b, _BLOCK):
        m = min(b, s + _BLOCK) - s
        x = srcs[0][s:s + m]
        for i in range(m):
            acc[i] = _to_single(x[i])
        for k in range(1, n):                       # rank order, as numpy's path
            x = srcs[k][s:s + m]
            for i in range(m):
                acc[i] += _to_single(x[i])
        if do_scale:
            for i in range(m):
                out[i] = _to_half(acc[i] * scale)
        else:
            for i in range(m):
                out[i] = _to_half(acc[i])
        for d in dsts:                              # every source read before any write
            y = d[s:s + m]
            for i in range(m):
                y[i] = out[i]
