"""float16 <-> float32 kernels (numba): conversions and the float16 reduction of the comm plane.

numpy converts float16 in software, one element at a time: on the machines we measured,
casting 64 MB of float32 to float16 took 0.1-0.6 s (depending on the values), a hundred
times a ``np.copyto`` of the same buffer.  PyTensor's numba backend has no float16 at all.
These kernels work on the bit patterns (float16 as ``uint16``, float32 reinterpreted as
``uint32``), one pass over memory, with the rounding of IEEE 754 and numpy
(round-to-nearest-even, subnormals kept):

* ``reduce_chunk(op, srcs, dsts, a, b)``: the ``sum``/``avg`` of float16 arrays of the
  comm plane (``shm.comm``): accumulated in float32 in rank order, the average scaled by
  ``float32(1/n)``, rounded once to float16, exactly as the numpy path (bit for bit) but
  without its temporary blocks;
* ``compress(src, dst, residual=None, scale=1)``: float32 -> float16 with error feedback:
  with a ``residual`` the value sent is ``float16((src + residual) * scale)`` and the
  residual becomes what that rounding lost (``(src + residual) - float32(sent) / scale``);
* ``decompress(src, dst, scale=1)``: float16 -> float32, divided by ``scale`` (exact: a
  power of two);
* ``finite_max`` and ``wire_scale``: the power of two an exchange multiplies its values by,
  agreed by every rank from every rank's largest finite magnitude, so that the float16 sum
  of all ranks stays within float16's range (values up to ``65504 * 2**110`` go through).

Finite values beyond float16's range are *saturated* to +-65504 by ``compress`` (a plain
cast would give inf, which no later step can undo; with error feedback the excess stays in
the residual); inf and nan are sent as they are and leave no residual.  ``reduce_chunk``
rounds as numpy does (overflow gives inf)."""
import numpy as np

try:
    from numba import njit, types
    from numba.extending import intrinsic
except ImportError:          # pragma: no cover - numba comes with PyTensor
    njit = None

F16_MAX = 65504.0

if njit is not None:
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
    def _compress(src, dst, scale):
        for i in range(src.size):
            dst[i] = _saturated(src[i] * scale)

    @njit(cache=True)
    def _compress_ef(src, res_in, dst, res_out, scale):
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
    def _decompress(src, dst, unscale):
        for i in range(src.size):
            dst[i] = _to_single(src[i]) * unscale

    @njit(cache=True)
    def _finite_max(src, res, with_res):
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
    def _reduce(srcs, dsts, a, b, scale, do_scale):
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


def available():
    return njit is not None


def _bits(arr, dtype):
    return arr.view(dtype) if arr.dtype != dtype else arr


def compress(src, dst, residual=None, residual_out=None, scale=1.0):
    """``dst`` (float16, flat) <- ``src`` (float32, flat) [+ ``residual``] times ``scale`` (a
    power of two, ``wire_scale``); with a residual, ``residual_out`` (may be ``residual``
    itself) <- what the rounding lost, in ``src``'s units."""
    s = np.asarray(src, np.float32).reshape(-1)
    d = dst.reshape(-1).view(np.uint16)
    if s.size != d.size:
        raise ValueError(f"compress: {s.size} values into {d.size}")
    if residual is None:
        _compress(s, d, np.float32(scale))
    else:
        r = residual.reshape(-1)
        ro = r if residual_out is None else residual_out.reshape(-1)
        _compress_ef(s, r, d, ro, np.float32(scale))
    return dst


def decompress(src, dst, scale=1.0):
    """``dst`` (float32) <- ``src`` (float16) divided by ``scale`` (what ``compress`` used),
    exactly."""
    s = src.reshape(-1).view(np.uint16)
    d = dst.reshape(-1)
    if s.size != d.size:
        raise ValueError(f"decompress: {s.size} values into {d.size}")
    _decompress(s, d, np.float32(1.0 / scale))
    return dst


def finite_max(values, residual=None):
    """The largest magnitude of the finite entries of ``values`` (+ ``residual``), 0.0 if
    none: what ``wire_scale`` needs (inf and nan entries leave the others' scale alone)."""
    v = np.asarray(values, np.float32).reshape(-1)
    if residual is None:
        return float(_finite_max(v, v, False))
    return float(_finite_max(v, np.asarray(residual, np.float32).reshape(-1), True))


MAX_SCALE_EXPONENT = 110        # 65504 * 2**110 still fits float32


def wire_scale(max_abs, n):
    """The power of two ``compress`` multiplies values by so that ``n`` of them (every
    rank's), each at most ``max_abs``, sum within float16's range with room for rounding:
    1.0 when they fit already (the values go on the wire as they are)."""
    need = 2.0 * n * float(max_abs) / F16_MAX
    if not need > 1.0:                                  # (also 0 and nan)
        return 1.0
    exponent = min(int(np.ceil(np.log2(need))), MAX_SCALE_EXPONENT)
    return float(2.0 ** -exponent)


def reduce_chunk(op, srcs, dsts, a, b, scale=None):
    """Elements ``[a, b)`` of flat float16 ``srcs`` (rank order) reduced (``sum``/``avg``,
    in float32) into every flat float16 ``dst``; ``avg`` multiplies the sum by
    ``float32(scale)`` (default ``1 / len(srcs)``).  Returns False (nothing done) where the
    arrays do not suit the kernel (not contiguous, read-only), for the caller's own path."""
    if njit is None or op not in ("sum", "avg"):
        return False
    arrs = list(srcs) + list(dsts)
    if not all(isinstance(x, np.ndarray) and x.dtype == np.float16 and x.ndim == 1
               and x.flags.c_contiguous and x.flags.writeable for x in arrs):
        return False
    s = tuple(x.view(np.uint16) for x in srcs)
    d = tuple(x.view(np.uint16) for x in dsts)
    scale = 1.0 / len(s) if scale is None else scale
    _reduce(s, d, a, b, np.float32(scale), op == "avg")
    return True


def reduce_into(op, srcs, dsts, a, b, scale=None):
    """``reduce_chunk``, with numpy doing the same (slowly) where the kernel cannot."""
    if reduce_chunk(op, srcs, dsts, a, b, scale):
        return
    acc = np.array(srcs[0][a:b], np.float32)
    for x in srcs[1:]:
        acc += x[a:b]
    if op == "avg":
        acc *= np.float32(1.0 / len(srcs) if scale is None else scale)
    for d in dsts:
        np.copyto(d[a:b], acc, casting="unsafe")
