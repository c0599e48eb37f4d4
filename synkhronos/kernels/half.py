"""float16 <-> float32 kernels (numba, in ``half_jit``, imported at first use): conversions
and the float16 reduction of the comm plane.

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
import importlib
import importlib.util
import sys

import numpy as np

from ..reductions import narrow_into

F16_MAX = 65504.0
_JIT = "synkhronos.kernels.half_jit"
_HAVE_NUMBA = importlib.util.find_spec("numba") is not None     # (numba comes with PyTensor)


def _jit():
    """The numba kernels (``half_jit``), imported at their first use."""
    return sys.modules.get(_JIT) or importlib.import_module(_JIT)


def available():
    return _HAVE_NUMBA


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
        _jit().compress(s, d, np.float32(scale))
    else:
        r = residual.reshape(-1)
        ro = r if residual_out is None else residual_out.reshape(-1)
        _jit().compress_ef(s, r, d, ro, np.float32(scale))
    return dst


def decompress(src, dst, scale=1.0):
    """``dst`` (float32) <- ``src`` (float16) divided by ``scale`` (what ``compress`` used),
    exactly."""
    s = src.reshape(-1).view(np.uint16)
    d = dst.reshape(-1)
    if s.size != d.size:
        raise ValueError(f"decompress: {s.size} values into {d.size}")
    _jit().decompress(s, d, np.float32(1.0 / scale))
    return dst


def finite_max(values, residual=None):
    """The largest magnitude of the finite entries of ``values`` (+ ``residual``), 0.0 if
    none: what ``wire_scale`` needs (inf and nan entries leave the others' scale alone)."""
    v = np.asarray(values, np.float32).reshape(-1)
    if residual is None:
        return float(_jit().finite_max(v, v, False))
    return float(_jit().finite_max(v, np.asarray(residual, np.float32).reshape(-1), True))


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
    if not _HAVE_NUMBA or op not in ("sum", "avg"):
        return False
    arrs = list(srcs) + list(dsts)
    if not all(isinstance(x, np.ndarray) and x.dtype == np.float16 and x.ndim == 1
               and x.flags.c_contiguous and x.flags.writeable for x in arrs):
        return False
    s = tuple(x.view(np.uint16) for x in srcs)
    d = tuple(x.view(np.uint16) for x in dsts)
    scale = 1.0 / len(s) if scale is None else scale
    _jit().sum_blocks(s, d, a, b, np.float32(scale), op == "avg")
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
        narrow_into(d[a:b], acc)         # (sums beyond 65504: inf, as numpy's float16 adds)
