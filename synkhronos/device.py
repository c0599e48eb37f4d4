"""The device plane: what one rank computes on.

A device says how many of its kind a machine has, how a worker process of a rank must be
started (its environment), how functions are compiled for it, where a shared variable's
value lives (``get``/``set`` its storage, without copies) and how arrays move between the
host and the device.  ``placement`` tells the comm plane where arrays live.

Implementations: ``CpuDevice`` (CPU cores; PyTensor's default backend, numba).  A GPU
device (PyTensor's JAX backend, one GPU per rank) implements the same interface."""
import os

import numpy as np

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS",
                "NUMBA_NUM_THREADS")


def usable_cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


class Device:
    """Interface of a device backend, bound to one rank's process."""

    kind = "abstract"
    placement = "host"

    @staticmethod
    def count():
        """Number of devices of this kind on the machine (0 if none)."""
        raise NotImplementedError

    def __init__(self, n, **settings):
        self.n = n

    def config(self):
        """What a worker needs to rebuild this device (json-able; ``kind`` names the class)."""
        return {"kind": self.kind}

    # ---- processes -------------------------------------------------------------------------
    def worker_env(self, rank):
        """Environment variables a worker process of ``rank`` starts with."""
        return {}

    def init_master(self, rank):
        """Prepare the master process to act as ``rank``; undone by ``release_master``."""

    def release_master(self):
        pass

    def init_worker(self, rank):
        """Prepare a freshly started worker process."""

    # ---- compiling -------------------------------------------------------------------------
    def compile(self, inputs, outputs, givens=None, **kwargs):
        """A PyTensor function for this device that trusts its inputs (they are checked by
        synkhronos in the master)."""
        import pytensor
        fn = pytensor.function(inputs, outputs, givens=givens, **kwargs)
        fn.trust_input = True
        return fn

    def adopt(self, fn):
        """Prepare a function unpickled in a worker."""
        fn.trust_input = True
        return fn

    # ---- values ----------------------------------------------------------------------------
    def get(self, var):
        """The value a shared variable holds on this rank, where it lives (no copy)."""
        return var.container.storage[0]

    def set(self, var, value):
        """Make ``value`` (an array of this device) the shared variable's value (no copy)."""
        var.container.storage[0] = value

    def to_host(self, arr):
        """A numpy array of ``arr`` (a view where possible)."""
        return np.asarray(arr)

    def to_device(self, arr):
        """``arr`` as an array of this device."""
        return arr

    def describe(self):
        return f"{self.n} {self.kind} rank(s)"


class CpuDevice(Device):
    """Ranks are CPU cores; each process gets ``cores // n`` threads (at least one)."""

    kind = "cpu"

    @staticmethod
    def count():
        return usable_cores()

    def __init__(self, n, **settings):
        super().__init__(n)
        self.cores = usable_cores()
        self.threads = max(1, self.cores // n)
        self._limits = None
        self._saved_env = None
        self._numba_threads = None

    def worker_env(self, rank):
        return {v: str(self.threads) for v in _THREAD_VARS}

    def init_master(self, rank):
        from threadpoolctl import threadpool_limits
        self._saved_env = {v: os.environ.get(v) for v in _THREAD_VARS}
        env = self.worker_env(rank)
        env.pop("NUMBA_NUM_THREADS")   # numba refuses a change once its pool exists; set below
        os.environ.update(env)         # libraries loaded later read these
        self._limits = threadpool_limits(limits=self.threads)
        try:
            import numba
            self._numba_threads = numba.get_num_threads()
            numba.set_num_threads(min(self.threads, numba.config.NUMBA_NUM_THREADS))
        except Exception:  # numba missing or its pool not configurable: nothing to limit
            self._numba_threads = None

    def release_master(self):
        if self._limits is not None:
            self._limits.restore_original_limits()
            self._limits = None
        if self._saved_env is not None:
            for k, v in self._saved_env.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            self._saved_env = None
        if self._numba_threads is not None:
            try:
                import numba
                numba.set_num_threads(self._numba_threads)
            except Exception:
                pass
            self._numba_threads = None

    def describe(self):
        return f"{self.n} CPU ranks on {self.cores} usable cores, {self.threads} thread(s) each"


def _device_class(kind):
    if kind == "cpu":
        return CpuDevice
    if kind == "jax":
        from .backends.jax_device import JaxDevice
        return JaxDevice
    raise ValueError(f"unknown device kind {kind!r}")


def gpu_count():
    """Number of GPUs usable by the GPU backend; 0 when it is not installed."""
    return 0


def make_device(config, n):
    """The device described by ``config`` (``Device.config()``) for ``n`` ranks: how a
    worker rebuilds the master's."""
    settings = dict(config)
    return _device_class(settings.pop("kind"))(n, **settings)


def _count_arg(n_parallel):
    if n_parallel is None:
        return None
    if isinstance(n_parallel, (bool, np.bool_)) or not isinstance(n_parallel, (int, np.integer)):
        raise TypeError(f"n_parallel must be a positive int or None, got {n_parallel!r}")
    if n_parallel < 1:
        raise ValueError(f"n_parallel must be at least 1, got {n_parallel}")
    return int(n_parallel)


def select_device(n_parallel, use_gpu, mode=None):
    """Pick the device and the number of ranks, validating the request in the master.

    ``mode``: PyTensor's compile mode for the ranks; None is numba on CPU cores, "JAX"
    runs PyTensor's JAX backend (on the CPU unless GPUs are used)."""
    n_parallel = _count_arg(n_parallel)
    if mode is not None and (not isinstance(mode, str) or mode.upper() not in ("JAX", "NUMBA")):
        raise ValueError(f"mode must be None, 'NUMBA' or 'JAX', got {mode!r}")
    if use_gpu is None:
        use_gpu = gpu_count() > 0
    if use_gpu:
        if gpu_count() == 0:
            raise NotImplementedError(
                "use_gpu=True but no GPU backend is available yet on this machine; "
                "use use_gpu=None or False for CPU workers.")
        raise NotImplementedError("The GPU backend is not implemented yet.")
    cls = _device_class("jax" if mode is not None and mode.upper() == "JAX" else "cpu")
    if n_parallel is None:
        n_parallel = CpuDevice.count()
    return cls(n_parallel)
