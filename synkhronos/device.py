"""The device plane: what one rank computes on.

A device says how many of its kind a machine has, how a worker process of a rank must be
started (its environment), how functions are compiled for it, where a shared variable's
value lives (``get``/``set`` its storage, without copies) and how arrays move between the
host and the device.  ``placement`` tells the comm plane where arrays live.

Implementations: ``CpuDevice`` (CPU cores; PyTensor's default backend, numba) and
``backends.jax_device.JaxDevice`` (PyTensor's JAX backend: one GPU per rank, or the CPU)."""
import contextlib
import os
import shutil
import subprocess

import numpy as np

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "BLIS_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS",
                "NUMBA_NUM_THREADS")


def usable_cores():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def generated_src_dir():
    """Where synkhronos has PyTensor keep the Python source of the graphs it compiles.

    PyTensor writes that source to a file; with its ``generated_src_dir`` unset, to a new
    temporary file per graph that it never removes (every worker, every run).  Synkhronos
    uses a content-addressed directory in PyTensor's compiledir instead, which PyTensor
    reuses across runs and prunes; a directory the user chose is kept."""
    import pytensor
    return pytensor.config.generated_src_dir or os.path.join(pytensor.config.compiledir, "generated_src")


@contextlib.contextmanager
def compiling():
    """Compile in here (master side): the user's PyTensor settings are back afterwards."""
    import pytensor
    cfg = pytensor.config
    saved = cfg.generated_src_dir
    cfg.generated_src_dir = generated_src_dir()
    try:
        yield
    finally:
        cfg.generated_src_dir = saved


def restore_env(saved):
    """Put back environment variables saved as ``{name: value or None (unset)}``; -> None."""
    for k, v in (saved or {}).items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    return None


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
        with compiling():
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
        """``arr`` as an array of this device (host memory it came from may be reused at once:
        a device array never aliases it)."""
        return arr

    def wait(self, arrays):
        """Block until ``arrays`` are computed; raises here if their computation failed
        (a device that computes asynchronously), before anything is kept or sent."""

    def explain(self, exc, rank, what, inputs):
        """A clearer exception for ``exc`` (raised by this device while rank ``rank``
        computed ``what`` on ``inputs``), or None to raise ``exc`` as it is."""
        return None

    def combine(self, mode, parts, weights=None):
        """``reductions.combine`` of arrays of this device, into an array of this device
        (a call's ``num_slices`` partial updates)."""
        from .reductions import combine
        return combine(mode, parts, weights)

    def describe(self):
        return f"{self.n} {self.kind} rank(s)"


class CpuDevice(Device):
    """Ranks are CPU cores; each process gets ``cores // n`` threads (at least one)."""

    kind = "cpu"

    @staticmethod
    def count():
        return usable_cores()

    def __init__(self, n, local_n=None, **settings):
        super().__init__(n)
        self.cores = usable_cores()
        self.local_n = local_n or n          # the ranks that share this host's cores
        self.threads = max(1, self.cores // self.local_n)
        self._limits = None
        self._saved_env = None
        self._numba_threads = None

    def config(self):
        return {"kind": self.kind, "local_n": self.local_n}

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
        self._saved_env = restore_env(self._saved_env)
        if self._numba_threads is not None:
            try:
                import numba
                numba.set_num_threads(self._numba_threads)
            except Exception:
                pass
            self._numba_threads = None

    def describe(self):
        if self.local_n != self.n:
            return f"{self.n} CPU ranks, {self.local_n} on this host's {self.cores} usable cores, " \
                   f"{self.threads} thread(s) each"
        return f"{self.n} CPU ranks on {self.cores} usable cores, {self.threads} thread(s) each"


def _device_class(kind):
    if kind == "cpu":
        return CpuDevice
    if kind == "jax":
        from .backends.jax_device import JaxDevice
        return JaxDevice
    raise ValueError(f"unknown device kind {kind!r}")


GPU_EXTRA = "pip install 'synkhronos[gpu]'  (JAX with its CUDA 12 wheels: jax[cuda12])"


def visible_gpus():
    """The GPUs this process may use, as the ids a worker's ``CUDA_VISIBLE_DEVICES`` takes,
    found without initialising CUDA here: the driver's GPUs (``/proc/driver/nvidia/gpus``,
    else ``nvidia-smi -L``), restricted by ``CUDA_VISIBLE_DEVICES`` when it is set.  Empty
    when there are none."""
    physical = _driver_gpu_count()
    if physical == 0:
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return [str(i) for i in range(physical)]
    ids = []
    for tok in env.split(","):
        tok = tok.strip()
        if tok.isdigit():
            if int(tok) >= physical or tok in ids:
                break                    # CUDA ignores the list from the first invalid entry on
        elif not tok.startswith(("GPU-", "MIG-")):
            break
        ids.append(tok)
    return ids


def _driver_gpu_count():
    try:
        return len([e for e in os.listdir("/proc/driver/nvidia/gpus") if not e.startswith(".")])
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def jax_installed():
    import importlib.util
    try:
        return importlib.util.find_spec("jax") is not None and importlib.util.find_spec("jaxlib") is not None
    except (ImportError, ValueError):
        return False


def gpu_backend_missing():
    """None when JAX with CUDA support is installed, else what is missing (no import of
    JAX, no CUDA initialisation)."""
    import importlib.util

    def have(mod):
        try:
            return importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            return False
    if not have("jax") or not have("jaxlib"):
        return "JAX is not installed"
    if not (have("jax_cuda12_plugin") or have("jax_plugins.xla_cuda12") or have("jax_cuda13_plugin")
            or have("jax_plugins.xla_cuda13")):
        return "JAX is installed without its CUDA plugin (jax[cuda12])"
    return None


def gpu_count():
    """Number of GPUs the GPU backend can use: the visible GPUs, or 0 when there are none or
    the backend (JAX with CUDA) is not installed.  Never initialises CUDA."""
    if gpu_backend_missing() is not None:
        return 0
    return len(visible_gpus())


def get_n_gpu():
    """Number of GPUs synkhronos can use on this machine (``gpu_count``)."""
    return gpu_count()


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


def select_device(n_parallel, use_gpu, mode=None, local_n=None):
    """Pick the device and the number of ranks, validating the request in the master.

    ``mode``: PyTensor's compile mode for the ranks; None is numba on CPU cores, "JAX"
    runs PyTensor's JAX backend (on the CPU unless GPUs are used)."""
    n_parallel = _count_arg(n_parallel)
    if mode is not None and (not isinstance(mode, str) or mode.upper() not in ("JAX", "NUMBA")):
        raise ValueError(f"mode must be None, 'NUMBA' or 'JAX', got {mode!r}")
    jax_mode = mode is not None and mode.upper() == "JAX"
    if use_gpu is None:
        use_gpu = gpu_count() > 0 and (mode is None or jax_mode)
    if use_gpu:
        if mode is not None and not jax_mode:
            raise ValueError(f"use_gpu=True runs PyTensor's JAX backend on the GPUs; mode={mode!r} cannot "
                             "run there (leave mode unset or use 'JAX')")
        return _gpu_device(n_parallel)
    if jax_mode and not jax_installed():
        raise RuntimeError("mode='JAX' runs PyTensor's JAX backend, but JAX is not installed: "
                           "pip install 'synkhronos[jax]' (or 'synkhronos[gpu]' for GPUs)")
    cls = _device_class("jax" if jax_mode else "cpu")
    if n_parallel is None:
        n_parallel = CpuDevice.count()
    return cls(n_parallel) if local_n is None else cls(n_parallel, local_n=local_n)


def _gpu_device(n_parallel):
    """The GPU device for ``n_parallel`` ranks (one GPU each), or an error saying what is
    missing and how to get it."""
    gpus = visible_gpus()
    missing = gpu_backend_missing()
    problems = []
    if not gpus:
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        problems.append("no GPU is visible" + (f" (CUDA_VISIBLE_DEVICES={env!r})" if env is not None else
                                               " (no NVIDIA driver: /proc/driver/nvidia/gpus and "
                                               "nvidia-smi found none)"))
    if missing:
        problems.append(f"{missing}; install the GPU extra: {GPU_EXTRA}")
    if problems:
        raise RuntimeError("use_gpu=True but " + " and ".join(problems) +
                           ". Use use_gpu=None or False for CPU ranks.")
    ranks = os.environ.get("SYNK_GPUS")
    if ranks:                  # explicit GPU per rank (may repeat: then collectives go through the host)
        chosen = [t.strip() for t in ranks.split(",") if t.strip()]
        unknown = [g for g in chosen if g not in gpus]
        if unknown:
            raise ValueError(f"SYNK_GPUS={ranks!r} names GPU(s) {unknown} that are not visible; visible: "
                             f"{gpus}")
        if n_parallel is not None and n_parallel != len(chosen):
            raise ValueError(f"n_parallel={n_parallel} but SYNK_GPUS={ranks!r} gives {len(chosen)} rank(s)")
    else:
        n = len(gpus) if n_parallel is None else n_parallel
        if n > len(gpus):
            raise ValueError(f"n_parallel={n} asks for {n} GPUs (one per rank) but {len(gpus)} "
                             f"{'is' if len(gpus) == 1 else 'are'} visible ({', '.join(gpus)}"
                             f"{'; CUDA_VISIBLE_DEVICES limits them' if 'CUDA_VISIBLE_DEVICES' in os.environ else ''}). "
                             f"Use n_parallel <= {len(gpus)}, or use_gpu=False for CPU ranks.")
        chosen = gpus[:n]
    return _device_class("jax")(len(chosen), platform="gpu", gpus=chosen, visible=gpus)
