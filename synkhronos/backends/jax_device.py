"""The JAX device: PyTensor's JAX backend, one device per rank.

On GPUs (``synk.fork(use_gpu=True)``, or ``use_gpu=None`` where GPUs and the ``gpu`` extra
are present) every rank owns one GPU: a worker is started with ``CUDA_VISIBLE_DEVICES`` set
to its GPU, the master selects its own through JAX's configuration before JAX starts.  On
the CPU (``synk.fork(mode="JAX")`` or ``SYNK_MODE=JAX``) every rank runs JAX's CPU backend
with its share of the cores, as ``CpuDevice`` gives numba.

Shared variables keep their values as JAX arrays on the rank's device (``get``/``set`` use
the storage directly: ``set_value`` would convert to numpy); a call's inputs go to the
device once, explicitly (``to_device``), outputs come back to the host (``to_host``).

Collectives of device arrays go through XLA's own multi-process collectives (NCCL on GPUs,
gloo on the CPU; ``xla_comm``) when every rank has its own GPU, else through the host
(``staged_comm``).  XLA's collectives need ``jax.distributed`` in every process before any
JAX use: the master hosts its coordination service on a loopback port it picks, as process
0 (processes are numbered from the master, ``(rank - master_rank) % n``).  The runtime is
set up so that JAX never ends the master (a recoverable service, connect failures as
exceptions, no preemption service, the session closed at exit before JAX's own teardown):
a lost rank ends in ``WorkerDied``, as on CPU ranks.  A worker whose master died is ended
by JAX's client at once (the next session's reaper removes the shared memory).

Settings (environment of the master):

* ``SYNK_JAX_COMM``: ``xla`` or ``staged`` (default: ``xla`` on GPUs, one per rank;
  ``staged`` on the CPU, where shared memory is much faster than gloo).
* ``SYNK_GPU_MEM_FRACTION``: fraction of each GPU JAX preallocates (default: none, memory
  is allocated as needed, ``XLA_PYTHON_CLIENT_PREALLOCATE=false``).  Your own
  ``XLA_PYTHON_CLIENT_*`` memory variables, when set, are kept instead.
* ``SYNK_GPUS``: the GPU of each rank, e.g. ``0,1`` (may repeat a GPU: then collectives go
  through the host, NCCL refusing two ranks on one GPU)."""
import os
import re
import socket
import sys
import threading

import numpy as np

from ..device import _THREAD_VARS, CpuDevice, Device, compiling, restore_env, usable_cores
from ..errors import DeviceMemoryError, MasterDied

_MEM_VARS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION",
             "XLA_PYTHON_CLIENT_ALLOCATOR")
HEARTBEAT_S = 100            # jax.distributed heartbeat timeout (SYNK_JAX_HEARTBEAT; a lost rank is noticed
                             # earlier by the launcher's liveness checks)
_ALIGN = 64                  # JAX's CPU client uses host memory this aligned in place


# ---- this process's JAX device ------------------------------------------------------------------

class _Local:
    """The JAX device this process computes on (one per process, whatever the session)."""

    def __init__(self):
        self.dev = None            # jax Device
        self.sharding = None
        self.gpu = False
        self.dist = None           # _Distributed while jax.distributed is up
        self.alive = None          # raises when the other processes' side is gone (while waiting)
        self.fast_put = None       # low-level explicit host -> device transfer, if available


_local = _Local()


def jax_started():
    """Whether JAX's backends are initialised in this process (without importing JAX)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except Exception:
        return True


def _configure(platform, gpu=None, gloo=False):
    """JAX's configuration for this process, before its backends start (later: no effect).
    PyTensor's JAX backend sets JAX's x64 mode from ``floatX`` when it is first imported:
    imported here, so that every process has the same mode before its first array."""
    import jax
    import pytensor.link.jax.dispatch  # noqa: F401
    if jax_started():
        return
    jax.config.update("jax_platforms", "cpu" if platform == "cpu" else "cuda,cpu")
    if gpu is not None:
        jax.config.update("jax_cuda_visible_devices", str(gpu))
    if gloo:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    for name, value in (("jax_enable_recoverability", True), ("jax_enable_preemption_service", False)):
        try:        # the preemption service would install its own SIGTERM handler
            jax.config.update(name, value)
        except Exception:
            pass


def _ensure():
    """This process's JAX device (starts JAX's backend on first use)."""
    if _local.dev is None:
        dist = _local.dist
        if dist is not None:
            dist.wait_ready(_local.alive)
        import jax
        from jax.sharding import SingleDeviceSharding
        dev = jax.local_devices()[0]
        jax.config.update("jax_default_device", dev)
        _local.sharding = SingleDeviceSharding(dev)
        _local.gpu = dev.platform != "cpu"
        _local.fast_put = _fast_put_impl()
        _local.dev = dev
    return _local.dev


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

    def put(x, sharding, dev):
        key = (x.shape, x.dtype)
        aval = avals.get(key)
        if aval is None:
            if len(avals) > 256:
                avals.clear()
            aval = avals[key] = aval_of(x.shape, x.dtype)
        with scope():
            return bdp(aval, sharding, [x], [dev], True)
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


def is_device_array(x):
    import jax
    return isinstance(x, jax.Array)


def to_device(arr):
    """``arr`` as an array of this process's device.  A JAX array already there is returned
    as it is; host memory is copied (the device array never aliases it: shared memory is
    reused by the next call)."""
    import jax
    dev = _ensure()
    if isinstance(arr, jax.Array):
        try:
            if arr.devices() == {dev}:
                return arr
        except Exception:
            pass
        return jax.device_put(arr, dev)
    x = np.asarray(arr)
    put = _local.fast_put
    if put is not None:
        canon = put.canon(x.dtype)
        if canon != x.dtype:
            x = x.astype(canon)
    if not _local.gpu:
        # the CPU client would use 64-byte aligned memory in place: give it a private copy
        # (small: numpy's own; large: aligned, so that it is used in place, one copy in all)
        x = np.array(x, copy=True, order="C") if x.nbytes < (256 << 10) else _aligned_copy(x)
    elif not x.flags.c_contiguous:
        x = np.ascontiguousarray(x)
    out = put(x, _local.sharding, dev) if put is not None else jax.device_put(x, dev)
    if _local.gpu:
        out.block_until_ready()     # the host memory may be rewritten as soon as we return
    return out


def to_host(arr):
    """A numpy array of ``arr``: on the CPU a read-only view of the device buffer (no copy)."""
    import jax
    if isinstance(arr, jax.Array):
        if not _local.gpu:
            return np.asarray(arr)
        return jax.device_get(arr)
    return np.asarray(arr)


# ---- jax.distributed ----------------------------------------------------------------------------

class _Distributed:
    """``jax.distributed`` set up as JAX's own ``initialize`` does, except that the client's
    error callback records errors instead of terminating the process, and that a thread
    connects and then starts JAX's backend: ``connect`` blocks until every process has
    connected, and a backend's start exchanges its devices with every other process, so
    all processes must do both at the same time, while their main threads go on (the
    master waits for its workers with its liveness checks).  ``wait_ready`` joins."""

    def __init__(self, address, n, pid, timeout):
        self.address, self.n, self.pid, self.timeout = address, n, pid, timeout
        self.service = self.client = None
        self.errors = []
        self.connected = threading.Event()
        self.ready = threading.Event()
        self.failure = None

    def _on_error(self, *args):
        self.errors.append(" ".join(str(a) for a in args))

    def start(self):
        from jax._src import distributed as jd
        try:
            from jax._src.lib import _jax
        except ImportError:                        # older jaxlib
            from jax._src.lib import xla_extension as _jax
        st = jd.global_state
        if st.client is not None or st.service is not None:
            raise RuntimeError("jax.distributed is already initialised in this process; synkhronos sets it "
                               "up itself for XLA's collectives (or set SYNK_JAX_COMM=staged)")
        timeout = max(10, int(self.timeout or 300))
        hb = _heartbeat()
        if self.pid == 0:
            self.service = _call_with_fallbacks(
                _jax.get_distributed_runtime_service, (self.address, self.n),
                dict(heartbeat_timeout=hb, shutdown_timeout=5, recoverable=True), ("recoverable",))
        # our callback: connect failures become exceptions (JAX's default ends the process)
        self.client = _call_with_fallbacks(
            _jax.get_distributed_runtime_client, (self.address, self.pid),
            dict(init_timeout=timeout, shutdown_timeout=5, heartbeat_timeout=hb,
                 missed_heartbeat_callback=self._on_error, shutdown_on_destruction=False, use_compression=True),
            ("use_compression", "shutdown_on_destruction", "missed_heartbeat_callback"))
        _local.dist = self
        threading.Thread(target=self._run, name="synk-jax-distributed", daemon=True).start()

    def _run(self):
        try:
            self.client.connect()
            from jax._src import distributed as jd
            st = jd.global_state
            st.service, st.client = self.service, self.client
            st.coordinator_address, st.num_processes, st.process_id = self.address, self.n, self.pid
            if hasattr(st, "partition_index"):
                st.partition_index = None
            self.connected.set()
            import jax
            jax.local_devices()            # the backend (its devices exchanged with every process)
        except BaseException as e:        # noqa: BLE001 - reported by wait_*
            self.failure = e
        finally:
            self.connected.set()
            self.ready.set()

    def _wait(self, event, alive, what):
        while not event.wait(0.1):
            if alive is not None:
                alive()
        if self.failure is not None:
            raise RuntimeError(f"synkhronos: jax.distributed: process {self.pid} of {self.n} could not {what} "
                               f"({self.address}): {self.failure}"
                               + (f"; {'; '.join(self.errors)}" if self.errors else "")) from self.failure

    def wait_connected(self, alive=None):
        """Block until every process has connected (``alive()`` raises when the other side
        is gone)."""
        self._wait(self.connected, alive, "connect")

    def wait_ready(self, alive=None):
        """Block until JAX's backend is up in this process."""
        self._wait(self.ready, alive, "start JAX's backend")

    def stop(self):
        """Disconnect (and stop the service, in the master).  Errors are ignored: the other
        processes may be gone already."""
        if _local.dist is self:
            _local.dist = None
        try:
            from jax._src import distributed as jd
            st = jd.global_state
            if st.client is self.client:
                st.client = st.service = None
        except Exception:
            pass
        if self.client is not None and self.connected.is_set() and self.failure is None:
            try:
                self.client.shutdown()
            except Exception:
                pass
        self.client = None
        if self.service is not None:
            try:
                self.service.shutdown()
            except Exception:
                pass
            self.service = None


def _call_with_fallbacks(fn, args, kwargs, optional):
    """``fn(*args, **kwargs)``, dropping the ``optional`` keywords (in order) that this JAX
    version does not take."""
    kwargs = dict(kwargs)
    for drop in (None,) + tuple(optional):
        if drop is not None:
            kwargs.pop(drop, None)
        try:
            return fn(*args, **kwargs)
        except TypeError as e:
            last = e
    raise last


def _heartbeat():
    raw = os.environ.get("SYNK_JAX_HEARTBEAT", "").strip()
    try:
        return max(1, int(float(raw))) if raw else HEARTBEAT_S
    except ValueError:
        raise ValueError(f"SYNK_JAX_HEARTBEAT={raw!r} must be a number of seconds") from None


def stop_distributed():
    """Leave ``jax.distributed`` (a worker at quit; the master once its workers are gone)."""
    dist = _local.dist
    if dist is not None:
        dist.stop()


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mem_settings():
    """GPU memory settings for every rank's environment."""
    if any(v in os.environ for v in _MEM_VARS):
        return {}                         # the user's own settings are inherited as they are
    frac = os.environ.get("SYNK_GPU_MEM_FRACTION", "").strip()
    if frac:
        try:
            f = float(frac)
        except ValueError:
            f = -1.0
        if not 0.0 < f <= 1.0:
            raise ValueError(f"SYNK_GPU_MEM_FRACTION={frac!r} must be a fraction in (0, 1]")
        return {"XLA_PYTHON_CLIENT_PREALLOCATE": "true", "XLA_PYTHON_CLIENT_MEM_FRACTION": frac}
    return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def _with_flag(flags, flag):
    name = flag.split("=", 1)[0]
    kept = [f for f in flags.split() if f.split("=", 1)[0] != name]
    return " ".join(kept + [flag])


# ---- combining partial updates on the device ------------------------------------------------------

_COMBINE = {}


def _combine_fn(mode, dtype, n_parts):
    key = (mode, str(dtype), n_parts)
    fn = _COMBINE.get(key)
    if fn is not None:
        return fn
    import jax
    import jax.numpy as jnp
    from ..reductions import accumulator
    dtype = np.dtype(dtype)
    acc = jnp.dtype(accumulator(mode, dtype))

    def body(parts, w):
        if mode == "avg":
            tot = parts[0].astype(acc) * w[0].astype(acc)
            for p, i in zip(parts[1:], range(1, n_parts)):
                tot = tot + p.astype(acc) * w[i].astype(acc)
            tot = tot / jnp.sum(w).astype(acc)
            if dtype.kind in "biu":
                tot = jnp.rint(tot)
            return tot.astype(dtype)
        op = {"sum": jnp.add, "prod": jnp.multiply, "max": jnp.maximum, "min": jnp.minimum}[mode]
        tot = parts[0].astype(acc)
        for p in parts[1:]:
            tot = op(tot, p.astype(acc))
        return tot.astype(dtype)
    fn = _COMBINE[key] = jax.jit(body)
    return fn


# ---- the device -----------------------------------------------------------------------------------

class JaxDevice(Device):
    """Ranks run PyTensor's JAX backend: one GPU each, or the CPU (``platform``)."""

    kind = "jax"
    placement = "device"

    @staticmethod
    def count():
        return usable_cores()

    def __init__(self, n, platform="cpu", gpus=None, visible=None, threads=None, mem=None, xla=None,
                 floatX=None, why_staged=None, local_n=None, **settings):
        super().__init__(n)
        self.local_n = local_n or n          # the ranks that share this host's cores
        if platform not in ("cpu", "gpu"):
            raise ValueError(f"JaxDevice platform must be 'cpu' or 'gpu', got {platform!r}")
        self.platform = platform
        self.gpus = list(gpus) if gpus else None
        self.visible = list(visible) if visible else self.gpus
        self.cores = usable_cores()
        self.threads = int(threads) if threads else max(1, self.cores // self.local_n)
        self.mem = dict(mem) if mem is not None else (_mem_settings() if platform == "gpu" else {})
        self.xla = xla                     # None, or how processes reach jax.distributed
        self.floatX = floatX
        self.why_staged = why_staged       # why collectives of device arrays go through the host
        self.master_rank = None
        self.alive = None
        self._cpu = None
        self._saved_env = None

    def config(self):
        return {"kind": self.kind, "platform": self.platform, "gpus": self.gpus, "visible": self.visible,
                "threads": self.threads, "mem": self.mem, "xla": self.xla, "floatX": self.floatX,
                "why_staged": self.why_staged, "local_n": self.local_n}

    # ---- the session's collectives (decided in the master, before workers start) -------------
    def plan_comm(self, master_rank, alive=None, timeout=None):
        """Decide how collectives of device arrays run: True for XLA's collectives (sets up
        what every process needs to join ``jax.distributed``), False for the host-staged
        path (``why_staged`` says why).  ``alive()`` raises when a worker is gone (the
        master checks it while it waits for JAX's start)."""
        self.master_rank = master_rank
        self.alive = alive
        try:
            import pytensor
            self.floatX = pytensor.config.floatX
        except Exception:
            pass
        want = os.environ.get("SYNK_JAX_COMM", "").strip().lower() or None
        if want not in (None, "xla", "staged"):
            raise ValueError(f"SYNK_JAX_COMM={want!r} must be 'xla' or 'staged'")
        why = None
        if self.n == 1:
            why = "one rank: no collective needs NCCL"
        elif want == "staged":
            why = "SYNK_JAX_COMM=staged"
        elif want is None and self.platform == "cpu":
            why = ("on the CPU the shared-memory path is faster than XLA's gloo collectives "
                   "(SYNK_JAX_COMM=xla selects them)")
        elif self.platform == "gpu" and len(set(self.gpus)) < len(self.gpus):
            why = (f"ranks share a GPU (GPUs by rank: {','.join(self.gpus)}); NCCL needs one GPU per rank")
        elif jax_started():
            why = ("JAX was already in use in this process before synk.fork(); XLA's multi-process "
                   "collectives must be set up before any JAX use (call synk.fork() first)")
        else:
            try:
                from jax._src import distributed as jd
                if jd.global_state.client is not None:
                    why = "jax.distributed was already initialised in this process by someone else"
            except Exception as e:
                why = f"this JAX has no usable jax.distributed ({e!r})"
        if why is not None and want == "xla" and self.n > 1:
            raise RuntimeError(f"SYNK_JAX_COMM=xla but XLA's collectives cannot be used: {why}")
        if why is None:
            port = _free_port()
            self.xla = {"address": f"127.0.0.1:{port}", "master_rank": master_rank, "master_pid": os.getpid(),
                        "timeout": timeout}
        self.why_staged = why
        return self.xla is not None

    def process_id(self, rank):
        return (rank - self.xla["master_rank"]) % self.n

    # ---- processes -------------------------------------------------------------------------
    def _cpu_limits(self):
        if self._cpu is None:
            self._cpu = CpuDevice(self.n, local_n=self.local_n)
            self._cpu.threads = self.threads
        return self._cpu

    def worker_env(self, rank):
        env = {v: str(self.threads) for v in _THREAD_VARS}
        if self.platform == "cpu":
            env["JAX_PLATFORMS"] = "cpu"
            if self.threads == 1:
                env["XLA_FLAGS"] = _with_flag(os.environ.get("XLA_FLAGS", ""), "--xla_cpu_multi_thread_eigen=false")
        else:
            env["JAX_PLATFORMS"] = "cuda,cpu"
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[rank]
            env.update(self.mem)
            if self.xla is not None:      # a lost rank aborts NCCL's communicators instead of hanging
                env["XLA_PYTHON_CLIENT_ABORT_COLLECTIVES_ON_FAILURE"] = "1"
                if "NCCL_SOCKET_IFNAME" not in os.environ:
                    env["NCCL_SOCKET_IFNAME"] = "lo"     # one host: NCCL's bootstrap on loopback only
        return env

    def init_master(self, rank):
        env = self.worker_env(rank)
        env.pop("CUDA_VISIBLE_DEVICES", None)     # the master's GPU is chosen through JAX's config
        env.pop("NUMBA_NUM_THREADS", None)        # numba refuses a change once its pool exists
        keys = set(env) | {"XLA_FLAGS"}
        self._saved_env = {k: os.environ.get(k) for k in keys}
        limits = self._cpu_limits()
        limits.init_master(rank)                  # BLAS/numba limits (and their variables)
        os.environ.update(env)
        gpu = None
        if self.platform == "gpu":
            gpu = self.visible.index(self.gpus[rank]) if self.gpus[rank] in self.visible else self.gpus[rank]
            if jax_started():
                _warn_started_master(self.gpus[rank])
        _configure(self.platform, gpu, gloo=self.xla is not None)
        _close_before_jax_exits()
        if self.xla is not None:
            _local.alive = self.alive
            _Distributed(self.xla["address"], self.n, self.process_id(rank), self.xla.get("timeout")).start()

    def release_master(self):
        stop_distributed()
        _local.alive = None
        if self._cpu is not None:
            self._cpu.release_master()
        self._saved_env = restore_env(self._saved_env)

    def init_worker(self, rank):
        if self.floatX:
            import pytensor
            if pytensor.config.floatX != self.floatX:      # JAX's x64 mode follows floatX
                pytensor.config.floatX = self.floatX
        _configure(self.platform, None, gloo=self.xla is not None)
        if self.xla is not None:
            master_pid = self.xla["master_pid"]

            def alive():
                if os.getppid() != master_pid:
                    raise MasterDied("master process is gone")
            _local.alive = alive
            d = _Distributed(self.xla["address"], self.n, self.process_id(rank), self.xla.get("timeout"))
            d.start()
            d.wait_connected(alive)    # (its backend starts meanwhile, with the master's: see _Distributed)
        else:
            _ensure()

    # ---- compiling -------------------------------------------------------------------------
    def compile(self, inputs, outputs, givens=None, **kwargs):
        import pytensor
        from pytensor.compile.mode import get_mode
        mode = kwargs.pop("mode", None)
        if mode is None:
            mode = "JAX"
        elif type(get_mode(mode).linker).__name__ != "JAXLinker":
            raise ValueError(f"this session runs PyTensor's JAX backend (synk.fork(mode='JAX') or GPUs); "
                             f"functions compile with mode='JAX', got mode={mode!r}")
        _ensure()
        from .jax_ops import declared

        with compiling():
            fn = pytensor.function(inputs, declared(outputs), givens=givens, mode=mode, **kwargs)
        return self.adopt(fn)

    def adopt(self, fn):
        _ensure()
        fn.trust_input = True
        for var in fn.get_shared():          # shared values move to the device now, explicitly
            self.get(var)
        return fn

    # ---- values ----------------------------------------------------------------------------
    def get(self, var):
        storage = var.container.storage
        value = storage[0]
        if isinstance(value, (np.ndarray, np.generic)):
            value = storage[0] = to_device(value)    # lives on the device from now on
        return value

    def set(self, var, value):
        if not is_device_array(value):
            value = to_device(value)
        var.container.storage[0] = value

    def to_host(self, arr):
        return to_host(arr)

    def to_device(self, arr):
        return to_device(arr)

    def combine(self, mode, parts, weights=None):
        if mode is None or len(parts) == 1:
            return parts[-1] if mode is None else parts[0]
        if mode == "gather":
            import jax.numpy as jnp
            return jnp.concatenate(parts, axis=0) if parts[0].ndim else jnp.stack(parts)
        w = np.ones(len(parts)) if weights is None else np.asarray(weights, np.float64)
        parts = [to_device(p) for p in parts]
        return _combine_fn(mode, parts[0].dtype, len(parts))(tuple(parts), to_device(w))

    def wait(self, arrays):
        import jax
        jax.block_until_ready(arrays)     # an XLA error surfaces here (reading a failed buffer aborts)

    def explain(self, exc, rank, what, inputs):
        """XLA's RESOURCE_EXHAUSTED becomes ``DeviceMemoryError`` naming the rank, its
        device, the failed allocation, this rank's inputs and the device's memory figures."""
        text = str(exc)
        if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
            return None
        detail = next((ln.strip() for ln in text.splitlines() if "RESOURCE_EXHAUSTED" in ln or
                       "out of memory" in ln.lower()), text.strip()).rstrip(".")
        m = re.search(r"(\d{4,}) bytes", detail)
        if m:
            detail += f" ({int(m.group(1)) / 2 ** 30:.2f} GiB)"
        stats = None
        try:
            stats = _ensure().memory_stats()     # None on the CPU
        except Exception:
            pass
        where = f"GPU {self.gpus[rank]}" if self.platform == "gpu" and self.gpus else "JAX CPU device"
        return DeviceMemoryError(rank, where, what, detail, _sizes(inputs), stats)

    def describe(self):
        if self.platform == "gpu":
            comm = "NCCL (XLA collectives)" if self.xla else "host-staged collectives"
            return f"{self.n} GPU rank(s) (GPU {', '.join(self.gpus)}), PyTensor JAX backend, {comm}"
        comm = "XLA gloo collectives" if self.xla else "shared-memory collectives"
        return (f"{self.n} JAX CPU rank(s) on {self.cores} usable cores, {self.threads} thread(s) each, "
                f"{comm}")


def _sizes(arrays):
    """``shape dtype`` of each array and their total size, for messages."""
    parts, total = [], 0
    for a in arrays:
        shape, dtype = getattr(a, "shape", ()), getattr(a, "dtype", None)
        nbytes = int(getattr(a, "nbytes", 0) or 0)
        total += nbytes
        parts.append(f"{tuple(shape)} {dtype}")
    return f"{', '.join(parts) or 'none'} ({total / 2 ** 20:.1f} MiB)"


_atexit_done = False


def _close_before_jax_exits():
    """At exit, close the session before JAX's own exit handler (registered when JAX was
    imported, so it would run first) clears the backends and leaves jax.distributed under
    the running workers."""
    global _atexit_done
    if _atexit_done:
        return
    import atexit

    def close():
        from .. import session
        session.close()
    atexit.register(close)
    _atexit_done = True


def _warn_started_master(gpu):
    print(f"synkhronos: warning: JAX was already started in this process before synk.fork(); the master "
          f"cannot pin itself to GPU {gpu} and uses JAX's default device (call synk.fork() before any "
          "JAX use)", file=sys.stderr, flush=True)


def wait_ready(arrays, waiter_wait, aborted=None):
    """Wait until ``arrays`` are computed, through ``waiter_wait(ready, sleep)`` (the control
    plane's waiter: liveness checks, stall warnings, timeout); raises their error, if any."""
    box = _Completion.submit(arrays)
    ev = box["event"]

    def ready():
        if ev.is_set():
            return True
        if aborted is not None and aborted():
            from ..errors import Aborted
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

