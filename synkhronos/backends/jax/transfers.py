"""Moving arrays between the host and this process's JAX device, and waiting for them.

Inputs go to the device once, explicitly (``to_device``: a private copy, never aliasing
host memory that the next call reuses); outputs come back with ``to_host`` (on the CPU a
read-only view of the device buffer, no copy).  ``wait_ready`` waits for device arrays with
the control plane's liveness checks (a collective whose peer died may never complete)."""
import os
import threading

import numpy as np

from .runtime import ensure, local

_ALIGN = 64                  # JAX's CPU client uses host memory this aligned in place
_put = []                    # the explicit transfer found by _fast_put_impl (once), or None


def _fast_put():
    if not _put:
        _put.append(_fast_put_impl())
    return _put[0]


def _fast_put_impl():
    """An explicit host -> device transfer of one numpy array without ``jax.device_put``'s
    pytree handling (~20 µs a call): JAX's own ``batched_device_put`` inside its explicit
    transfer scope (so a ``transfer_guard`` still sees an explicit transfer).  None when
    this JAX version lacks them."""
    try:
        from jax._src import config as jcfg
        from jax._src import core, dtypes
        from jax._src.lib import xla_client as xc
        scope, bdp, aval_of, canon = (jcfg.explicit_device_put_scope, xc.batched_device_put, core.ShapedArray,
                                      dtypes.canonicalize_dtype)
    except Exception:
        return None

    avals = {}

    def aval(x):
        key = (x.shape, x.dtype)
        a = avals.get(key)
        if a is None:
            if len(avals) > 256:
                avals.clear()
            a = avals[key] = aval_of(x.shape, x.dtype)
        return a

    def put(x, sharding, dev):
        with scope():
            return bdp(aval(x), sharding, [x], [dev], True)

    def put_many(xs, sharding, dev):
        with scope():
            return [bdp(aval(x), sharding, [x], [dev], True) for x in xs]
    try:
        import jax
        probe = np.zeros(2, np.float32)
        dev = jax.local_devices()[0]
        from jax.sharding import SingleDeviceSharding
        out = put(probe, SingleDeviceSharding(dev), dev)
        if not isinstance(out, jax.Array) or out.shape != (2,):
            return None
    except Exception:
        return None
    put.canon = canon
    put.many = put_many
    return put


def _aligned_copy(x):
    """A private, ``_ALIGN``-aligned C-contiguous copy of ``x`` (JAX's CPU client then uses it
    in place: one copy in all)."""
    nbytes = x.nbytes
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    off = (-raw.ctypes.data) % _ALIGN
    out = raw[off:off + nbytes].view(x.dtype).reshape(x.shape)
    np.copyto(out, x)
    return out


_jax_array = []              # [jax.Array], once JAX is imported


def is_device_array(x):
    if not _jax_array:
        import jax
        _jax_array.append(jax.Array)
    return isinstance(x, _jax_array[0])


_scopes = {}                 # JAX's explicit-transfer scope by name (None: this JAX lacks it)


def _jax_scope(name):
    """JAX's context manager factory ``name`` (``explicit_device_put_scope``,
    ``explicit_device_get_scope``), or None when this JAX lacks it."""
    if name not in _scopes:
        try:
            from jax._src import config as jcfg
            _scopes[name] = getattr(jcfg, name)
        except Exception:
            _scopes[name] = None
    return _scopes[name]


def to_devices(arrays):
    """``to_device`` of each of ``arrays``, in one explicit transfer, without waiting on a
    GPU for the copies to be done: the caller waits (see ``JaxDevice.call_inputs``)."""
    import jax
    put = _fast_put()
    if put is None or any(isinstance(a, jax.Array) for a in arrays):
        return [to_device(a, wait=False) for a in arrays]
    dev = ensure()
    return put.many([_host_copy(np.asarray(a), put) for a in arrays], local.sharding, dev)


_IN_DISPATCH_MAX = {False: 256 << 10, True: 64 << 10}   # bytes, on the CPU / on a GPU


def put_scope():
    """JAX's explicit-transfer scope (a context manager factory), or None when this JAX
    lacks it.  A jitted call dispatched inside it transfers its host arguments as explicit
    transfers (a ``transfer_guard("disallow")`` allows them, as it allows ``device_put``)."""
    return _jax_scope("explicit_device_put_scope")


_guard = []                  # [(thread state, process state, ALLOW) of JAX's transfer guard] or [None]


def host_transfers_guarded():
    """Whether a transfer guard may refuse implicit host -> device transfers in this thread
    now (this thread's level, else the process's, is set and is not "allow"); True where
    this JAX does not say.  Entering the explicit-transfer scope cost a jitted dispatch
    15-20 µs on a JAX CPU device (timed by hand, 2-core machine): it is entered only when
    a guard could refuse."""
    if not _guard:
        try:
            from jax._src.lib import guard_lib
            _guard.append((guard_lib.thread_local_state, guard_lib.global_state, guard_lib.TransferGuardLevel.ALLOW))
        except Exception:            # noqa: BLE001 - (unknown: as if guarded)
            _guard.append(None)
    g = _guard[0]
    if g is None:
        return True
    level = g[0]().host_to_device
    if level is None:
        level = g[1]().host_to_device
    return level is not None and level != g[2]


def call_arrays(arrays):
    """A call's inputs as its jitted function takes them: a small host array (up to
    ``_IN_DISPATCH_MAX`` bytes) as a private host copy in JAX's dtype, which the call's
    dispatch transfers itself (explicitly: ``held.Held``), as a plain JAX call does with
    numpy arguments (an explicit transfer ahead of the dispatch costs ~50 µs more for two
    small inputs on a CPU device); larger ones and device arrays as ``to_devices`` gives them.
    Returns ``(arrays, transferred)``: ``transferred`` are the device arrays made here."""
    put = _fast_put()
    if put is None or put_scope() is None:
        moved = to_devices(arrays)
        return moved, moved
    limit = _IN_DISPATCH_MAX[local.gpu]
    out, big = list(arrays), []
    for i, a in enumerate(arrays):
        if not hasattr(a, "__array__") or is_device_array(a):
            big.append(i)
            continue
        x = np.asarray(a)
        if x.nbytes > limit:
            big.append(i)
            continue
        canon = put.canon(x.dtype)
        out[i] = x.astype(canon, order="C", copy=True)   # (private: the caller's memory may be reused)
    if not big:
        return out, []
    moved = to_devices([arrays[i] for i in big])
    for i, m in zip(big, moved):
        out[i] = m
    return out, moved


def _host_copy(x, put):
    """What goes to the device for host array ``x``: JAX's dtype (x64 mode), and on the CPU a
    private copy (JAX's CPU client uses 64-byte aligned memory in place: small arrays get
    numpy's copy, large ones an aligned one, so that it is used in place, one copy in all)."""
    canon = put.canon(x.dtype)
    if canon != x.dtype:
        x = x.astype(canon)
    if not local.gpu:
        return np.array(x, copy=True, order="C") if x.nbytes < (256 << 10) else _aligned_copy(x)
    return x if x.flags.c_contiguous else np.ascontiguousarray(x)


def to_device(arr, wait=True):
    """``arr`` as an array of this process's device.  A JAX array already there is returned
    as it is; host memory is copied (the device array never aliases it: shared memory is
    reused by the next call).  On a GPU the copy is waited for unless ``wait`` is false."""
    import jax
    dev = ensure()
    if isinstance(arr, jax.Array):
        try:
            if arr.devices() == {dev}:
                return arr
        except Exception:
            pass
        return jax.device_put(arr, dev)
    x = np.asarray(arr)
    put = _fast_put()
    if put is None:
        if not local.gpu:
            x = np.array(x, copy=True, order="C")
        out = jax.device_put(x, dev)
    else:
        out = put(_host_copy(x, put), local.sharding, dev)
    if local.gpu and wait:
        out.block_until_ready()     # the host memory may be rewritten as soon as we return
    return out


def to_host(arr):
    """A numpy array of ``arr`` (read-only): on the CPU a view of the device buffer (no
    copy); from a GPU, small arrays by JAX's own read, large ones (``_PINNED_MIN`` bytes and
    up) through page-locked host memory (``_pinned_read``)."""
    import jax
    if isinstance(arr, jax.Array):
        if local.gpu and arr.nbytes >= _PINNED_MIN:
            out = _pinned_read(arr)
            if out is not None:
                return out
        if local.gpu:
            return _explicit_read(arr)
        return np.asarray(arr)
    return np.asarray(arr)


def read_into(arr, out):
    """``arr``'s value written into the host array ``out`` (its shape and dtype, C order):
    from a GPU by the copy engine straight into ``out`` (``pinning.copy_to_host``: DMA
    into page-locked shared memory, no host copy; not yet timed on a GPU), else a copy of
    ``to_host(arr)`` (on the CPU a view: one copy in all)."""
    if local.gpu and _direct_read(arr, out):
        return
    np.copyto(out, to_host(arr))


_DRIVER_COPY = os.environ.get("SYNK_STAGED_COPY", "driver").strip().lower() != "jax"   # (gpu_check compares)


def _direct_read(arr, out):
    """Whether ``arr`` (one buffer on this process's GPU) was copied into ``out`` by the
    driver: ``arr`` waited for first (a failed computation raises here); False where this
    cannot be done (another array type, a sharded array, no driver, a layout not checked)."""
    from . import pinning
    if not (_DRIVER_COPY and is_device_array(arr) and out.flags.c_contiguous and out.dtype == arr.dtype
            and out.shape == arr.shape and out.nbytes and _layout_checked()):
        return False
    arr.block_until_ready()
    try:
        src = arr.unsafe_buffer_pointer()
    except Exception:                 # noqa: BLE001 - (not one buffer: JAX's read)
        return False
    return pinning.copy_to_host(src, out.ctypes.data, out.nbytes)


_layout = []                 # [whether device buffers are dense C-order arrays, as checked once]


def _layout_checked():
    """A GPU buffer read byte for byte gives numpy's C order (checked once on a transposed
    2-D result against JAX's own read)."""
    if not _layout:
        ok = False
        try:
            import jax
            import jax.numpy as jnp
            from . import pinning
            a = jax.jit(lambda: jnp.arange(12 * 20, dtype=jnp.float32).reshape(12, 20).T * 2)()
            a.block_until_ready()
            want = _explicit_read(a)         # (no transfer a transfer guard could refuse)
            got = np.empty_like(want)
            ok = pinning.copy_to_host(a.unsafe_buffer_pointer(), got.ctypes.data, got.nbytes) \
                and np.array_equal(got, want)
        except Exception:             # noqa: BLE001 - JAX's read then
            ok = False
        _layout.append(ok)
    return _layout[0]


def start_reads(arrays):
    """Start copying the small device arrays among ``arrays`` to the host (JAX's
    ``copy_to_host_async``, queued behind their computation), so that ``to_host`` finds
    them there: waiting for a computation and then reading its result would otherwise be
    two synchronisations with the GPU where a plain call's read is one.  A failed
    computation is still raised by the wait (the copy is never waited for)."""
    import jax
    for a in arrays:
        if isinstance(a, jax.Array) and a.nbytes < _PINNED_MIN:
            try:
                a.copy_to_host_async()
            except Exception:        # noqa: BLE001 - (the read will say what is wrong)
                pass


def _explicit_read(arr):
    """JAX's own read of a device array, as the explicit transfer ``jax.device_get`` makes
    (a ``transfer_guard`` allows it) without its pytree handling (~100 us a call on a GPU)."""
    scope = _jax_scope("explicit_device_get_scope")
    if scope is None:
        import jax
        return jax.device_get(arr)
    with scope():
        return np.asarray(arr)


_PINNED_MIN = 1 << 20
_pinned = []                 # [the pinned-host sharding of this process's device, or None]


def _pinned_read(arr):
    """``arr`` (on this process's GPU) copied to page-locked host memory by the GPU's copy
    engine and viewed by numpy through DLPack, no further copy: 44 GB/s from an H100,
    against 1.5 GB/s for JAX's read into pageable memory at 64 MB (bench_transfers.py).
    None where this JAX cannot (no ``pinned_host`` memory, no DLPack view of it)."""
    if not _pinned:
        _pinned.append(_pinned_sharding())
    sharding = _pinned[0]
    if sharding is None:
        return None
    import jax
    p = jax.device_put(arr, sharding)
    p.block_until_ready()            # (a failed computation raises here)
    try:
        return np.from_dlpack(p)     # (the view keeps the pinned buffer alive)
    except (TypeError, ValueError, BufferError, RuntimeError):
        return None                  # a dtype numpy takes no DLPack view of (bfloat16)


def _pinned_sharding():
    """The ``pinned_host`` sharding of this process's GPU, checked once on a small array
    (values and a zero-copy view), or None."""
    try:
        import jax
        from jax.sharding import SingleDeviceSharding
        dev = ensure()
        sharding = SingleDeviceSharding(dev, memory_kind="pinned_host")
        probe = np.arange(1024, dtype=np.float32)
        p = jax.device_put(jax.device_put(probe, dev), sharding)
        p.block_until_ready()
        view = np.from_dlpack(p)
        if view.ctypes.data != p.unsafe_buffer_pointer() or not np.array_equal(view, probe):
            return None
        return sharding
    except Exception:
        return None


_DONE_GRACE_S = 0.05         # how long an aborted wait still looks for arrays that are computed


def wait_ready(arrays, waiter_wait, aborted=None):
    """Wait until ``arrays`` are computed, through ``waiter_wait(ready, sleep)`` (the control
    plane's waiter: liveness checks, stall warnings, timeout); raises their error, if any."""
    _wait_box(_Completion.submit(arrays), waiter_wait, aborted)


def run_ready(dispatch, waiter_wait, aborted=None):
    """``dispatch()``'s arrays, computed: dispatched and waited for by a thread of its own
    while this one waits as ``wait_ready`` does.  For programs that a device runs inside
    their dispatch (XLA's CPU client runs programs with collectives so): a peer that stops
    inside a collective would otherwise hold this thread where no liveness check runs.
    The thread of a program that never ends ends with the session (its peers' sockets close)."""
    box = {"event": threading.Event()}

    def run():
        try:
            import jax
            box["arrays"] = jax.block_until_ready(dispatch())
        except BaseException as e:     # noqa: BLE001 - handed to the waiting caller
            box["error"] = e
        box["event"].set()
    threading.Thread(target=run, name="synk-xla-program", daemon=True).start()
    _wait_box(box, waiter_wait, aborted)
    return box["arrays"]


def _wait_box(box, waiter_wait, aborted):
    ev = box["event"]

    def ready():
        if ev.is_set():
            return True
        if aborted is not None and aborted():
            if ev.wait(_DONE_GRACE_S):    # done here (its collectives with it): nothing is pending
                return True
            from ...errors import Aborted
            raise Aborted("another rank failed during this collective")
        return False
    waiter_wait(ready, ev.wait)
    if "error" in box:
        raise box["error"]


class _Completion:
    """One daemon thread that blocks on JAX arrays, so that the caller can wait on an event
    with its liveness checks (a collective whose peer died may never complete)."""

    _lock = threading.Lock()
    _queue = None

    @classmethod
    def submit(cls, arrays):
        import queue
        box = {"event": threading.Event()}
        with cls._lock:
            if cls._queue is None:
                cls._queue = queue.SimpleQueue()
                threading.Thread(target=cls._run, args=(cls._queue,), name="synk-jax-wait", daemon=True).start()
            cls._queue.put((arrays, box))
        return box

    @staticmethod
    def _run(q):
        import jax
        while True:
            arrays, box = q.get()
            try:
                jax.block_until_ready(arrays)
            except BaseException as e:     # noqa: BLE001 - handed to the waiting caller
                box["error"] = e
            box["event"].set()
