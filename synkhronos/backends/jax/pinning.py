"""Page-locked shared memory for a GPU rank's copies (CUDA's driver API, through ctypes).

JAX copies host memory to a GPU by DMA when that memory is page-locked, else through a
bounce buffer: 64 MB took 1.7 ms from a page-locked shared-memory segment against 8.2 ms
from pageable memory on an H100 host (``benchmarks/bench_transfers.py``).  A GPU rank
therefore page-locks (``cuMemHostRegister``, portable to every context) each shared-memory
segment of at least ``MIN_BYTES`` it maps: the ``synk.Data`` its calls read, the slots of
the host-staged collectives.  A segment is unlocked when it goes or its memory is given
back, before that memory is unmapped.  What the driver refuses stays pageable (slower, the
same values); ``status()`` says how it went."""
import ctypes
import os
import threading
import weakref

MIN_BYTES = 512 << 10
_PORTABLE = 1                # CU_MEMHOSTREGISTER_PORTABLE
_state = {"pinner": None, "why": "not started (no GPU rank in this process)"}


def install(ordinal):
    """Page-lock this process's shared-memory segments for CUDA device ``ordinal`` (the
    GPU JAX computes on), those mapped already and those to come.  Once per process;
    returns whether it is on."""
    if _state["pinner"] is not None:
        return True
    try:
        pinner = _Pinner(_driver(), ordinal)
    except Exception as e:      # no driver library, no device: pageable copies
        _state["why"] = f"off: {e}"
        return False
    from ..shm import segments
    _state["pinner"] = pinner
    _state["why"] = None
    segments.observe(pinner)
    return True


def status():
    """``"on: k segments (x MiB) page-locked, r refused"`` or why it is off."""
    p = _state["pinner"]
    if p is None:
        return _state["why"]
    return (f"on: {len(p.pinned)} segment(s) ({sum(p.pinned.values()) / 2 ** 20:.1f} MiB) page-locked, "
            f"{p.refused} refused" + (f" (last: CUDA error {p.last_error})" if p.refused else ""))


class _Pinner:
    """The ``segments.observe`` observer that page-locks segments."""

    def __init__(self, cu, ordinal):
        self.cu, self.pid = cu, os.getpid()
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        _check(cu.cuDeviceGet(ctypes.byref(dev), int(ordinal)), "cuDeviceGet")
        _check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self.ctx = ctx
        self.lock = threading.RLock()     # (a finalizer may run inside, at a collection)
        self.pinned = {}           # address -> bytes
        self.refused = 0
        self.last_error = None

    def _in_context(self, fn, *args):
        """``fn(*args)`` with the device's primary context current in this thread (the
        thread's own context restored after); the CUDA result code."""
        if self.cu.cuCtxPushCurrent_v2(self.ctx) != 0:
            return -1
        try:
            return fn(*args)
        finally:
            self.cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def copy_to_host(self, src, dst, nbytes):
        if os.getpid() != self.pid:
            return False
        return self._in_context(self.cu.cuMemcpyDtoH_v2, ctypes.c_void_p(dst), ctypes.c_uint64(src),
                                ctypes.c_size_t(nbytes)) == 0

    def mapped(self, seg):
        if seg.size < MIN_BYTES or os.getpid() != self.pid:
            return
        addr, size = seg.address(), seg.size
        with self.lock:
            if addr in self.pinned:
                return
            rc = self._in_context(self.cu.cuMemHostRegister_v2, ctypes.c_void_p(addr), ctypes.c_size_t(size),
                                  ctypes.c_uint(_PORTABLE))
            if rc != 0:
                self.refused += 1
                self.last_error = rc
                return
            self.pinned[addr] = size
        weakref.finalize(seg, self._unpin, addr)

    def released(self, seg):
        if os.getpid() == self.pid:
            self._unpin(seg.address())

    def _unpin(self, addr):
        with self.lock:
            if self.pinned.pop(addr, None) is None or os.getpid() != self.pid:
                return
            self._in_context(self.cu.cuMemHostUnregister, ctypes.c_void_p(addr))


def copy_to_host(src, dst, nbytes):
    """``nbytes`` from device address ``src`` (this process's GPU, computed) to host address
    ``dst`` by the driver (``cuMemcpyDtoH``: DMA at the link's speed when ``dst`` is
    page-locked); whether it was done (False: no driver here, or it refused)."""
    p = _state["pinner"]
    return p is not None and p.copy_to_host(src, dst, nbytes)


def _driver():
    cu = ctypes.CDLL("libcuda.so.1")
    cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
    cu.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    cu.cuMemHostUnregister.argtypes = [ctypes.c_void_p]
    cu.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
    cu.cuCtxPopCurrent_v2.argtypes = [ctypes.c_void_p]
    _check(cu.cuInit(0), "cuInit")
    return cu


def _check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what}: CUDA error {rc}")
