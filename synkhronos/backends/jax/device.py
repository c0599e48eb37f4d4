"""The ``jax`` device: PyTensor's JAX backend, one device per rank.

On GPUs (``synk.fork(use_gpu=True)``, or ``use_gpu=None`` where GPUs and the ``gpu`` extra
are present) every rank owns one GPU: a worker is started with ``CUDA_VISIBLE_DEVICES`` set
to its GPU, the master selects its own through JAX's configuration before JAX starts.  On
the CPU (``synk.fork(mode="JAX")`` or ``SYNK_MODE=JAX``) every rank runs JAX's CPU backend
with its share of the cores, as the ``cpu`` device gives numba.

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
* ``SYNK_STAGED_REDUCE``: ``device`` or ``host``: where a host-staged ``all_reduce`` adds
  (default: on the device on GPUs, on the host on the CPU).
* ``SYNK_STAGED_COPY``: ``driver`` or ``jax``: how a GPU's value goes into its slot when the
  device adds (default ``driver``: the CUDA driver's copy straight into the page-locked
  slot; ``jax``: JAX's read, then a host copy).
* ``SYNK_GPUS``: the GPU of each rank, e.g. ``0,1`` (may repeat a GPU: then collectives go
  through the host, NCCL refusing two ranks on one GPU)."""

import os
import re

import numpy as np

from . import compile_cache, distributed, generators, runtime
from .transfers import call_arrays, is_device_array, read_into, start_reads, to_device, to_host
from ..host.device import THREAD_VARS, ThreadLimits, restore_env, usable_cores
from ...compiling import compiling
from ...errors import DeviceMemoryError, MasterDied

_MEM_VARS = ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION",
             "XLA_PYTHON_CLIENT_ALLOCATOR")


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


def _staged_reduce(platform):
    """Where host-staged all-reduces add: ``"all"`` on the device (``SYNK_STAGED_REDUCE=device``),
    ``"large"`` on the device from ``staged_comm.DEVICE_MIN_BYTES`` on (the default on GPUs:
    the adds at the GPU's speed, one host copy fewer; small values take the host's one-meeting
    path), None on the host (``host``; the default on the CPU, where the ranks' shared-memory
    reduction splits the work among them)."""
    want = os.environ.get("SYNK_STAGED_REDUCE", "").strip().lower()
    if want not in ("", "device", "host"):
        raise ValueError(f"SYNK_STAGED_REDUCE={want!r} must be 'device' or 'host'")
    if want:
        return "all" if want == "device" else None
    return "large" if platform == "gpu" else None


def _with_flag(flags, flag):
    name = flag.split("=", 1)[0]
    kept = [f for f in flags.split() if f.split("=", 1)[0] != name]
    return " ".join(kept + [flag])


_COMBINE = {}


def _combine_fn(mode, dtype, n_parts):
    key = (mode, str(dtype), n_parts)
    fn = _COMBINE.get(key)
    if fn is not None:
        return fn
    import jax
    import jax.numpy as jnp
    from ...reductions import accumulator
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
    from .held import Held        # (a Ctrl-C in its first dispatch, which compiles, lands as itself)
    fn = _COMBINE[key] = Held(jax.jit(body))
    return fn


class JaxDevice:
    """Ranks run PyTensor's JAX backend: one GPU each, or the CPU (``platform``)."""

    kind = "jax"
    placement = "device"
    runs_host_ops = True        # graphs holding in-graph collectives compile in stretches (host_ops)

    @staticmethod
    def count():
        return usable_cores()

    def __init__(self, n, platform="cpu", gpus=None, visible=None, threads=None, mem=None, xla=None,
                 floatX=None, why_staged=None, local_n=None, matmul_precision=None, reduce_on_device=None,
                 compile_cache=None):
        self.n = n
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
        self.reduce_on_device = reduce_on_device    # host-staged all_reduce adds on the device: "all", "large", None
        self.matmul_precision = matmul_precision    # None: the master's JAX setting (in plan_comm)
        self.compile_cache = compile_cache          # JAX's persistent cache of every rank (plan_comm)
        self._saved_cache = None
        self.master_rank = None
        self.alive = None
        self._limits = None
        self._saved_env = None
        self._inflight = []                # call inputs on their way to the GPU (call_inputs)

    def config(self):
        return {"kind": self.kind, "platform": self.platform, "gpus": self.gpus, "visible": self.visible,
                "threads": self.threads, "mem": self.mem, "xla": self.xla, "floatX": self.floatX,
                "why_staged": self.why_staged, "local_n": self.local_n,
                "matmul_precision": self.matmul_precision, "reduce_on_device": self.reduce_on_device,
                "compile_cache": self.compile_cache}

    # ---- the session's collectives (decided in the master, before workers start) -------------
    def plan_comm(self, master_rank, alive=None, timeout=None, several_hosts=False):
        """Decide how collectives of device arrays run: True for XLA's collectives (sets up
        what every process needs to join ``jax.distributed``), False for the host-staged
        path (``why_staged`` says why).  ``alive()`` raises when a worker is gone (the
        master checks it while it waits for JAX's start).  ``several_hosts``: the ranks are
        on several hosts (``mpiexec``): always the host path (each host's shared memory, MPI
        between the hosts)."""
        self.master_rank = master_rank
        self.alive = alive
        try:
            import pytensor
            self.floatX = pytensor.config.floatX
        except Exception:
            pass
        if self.matmul_precision is None:      # JAX's own setting in the master, for every rank
            self.matmul_precision = runtime.current_precision()
        self.compile_cache = compile_cache.plan()
        want = os.environ.get("SYNK_JAX_COMM", "").strip().lower() or None
        if want not in (None, "xla", "staged"):
            raise ValueError(f"SYNK_JAX_COMM={want!r} must be 'xla' or 'staged'")
        why = None
        if several_hosts:
            why = "ranks on several hosts: collectives go through each host's memory and MPI"
        elif self.n == 1:
            why = "one rank: no collective needs NCCL"
        elif want == "staged":
            why = "SYNK_JAX_COMM=staged"
        elif want is None and self.platform == "cpu":
            why = ("on the CPU the shared-memory path is faster than XLA's gloo collectives "
                   "(SYNK_JAX_COMM=xla selects them)")
        elif self.platform == "gpu" and len(set(self.gpus)) < len(self.gpus):
            why = (f"ranks share a GPU (GPUs by rank: {','.join(self.gpus)}); NCCL needs one GPU per rank")
        elif runtime.jax_started():
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
            port = distributed.free_port()
            self.xla = {"address": f"127.0.0.1:{port}", "master_rank": master_rank, "master_pid": os.getpid(),
                        "timeout": timeout}
        self.why_staged = why
        self.reduce_on_device = _staged_reduce(self.platform)
        return self.xla is not None

    def process_id(self, rank):
        return (rank - self.xla["master_rank"]) % self.n

    # ---- processes -------------------------------------------------------------------------
    def worker_env(self, rank):
        env = {v: str(self.threads) for v in THREAD_VARS}
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

    def init_master(self, rank, close_session):
        env = self.worker_env(rank)
        env.pop("CUDA_VISIBLE_DEVICES", None)     # the master's GPU is chosen through JAX's config
        env.pop("NUMBA_NUM_THREADS", None)        # numba refuses a change once its pool exists
        keys = set(env) | {"XLA_FLAGS"}
        self._saved_env = {k: os.environ.get(k) for k in keys}
        self._limits = ThreadLimits(self.threads)
        self._limits.apply()                      # BLAS/numba limits (and their variables)
        os.environ.update(env)
        gpu = None
        if self.platform == "gpu":
            gpu = self.visible.index(self.gpus[rank]) if self.gpus[rank] in self.visible else self.gpus[rank]
            if runtime.jax_started():
                runtime.warn_started_master(self.gpus[rank])
        self._saved_precision = runtime.current_precision()
        runtime.configure(self.platform, gpu, gloo=self.xla is not None, precision=self.matmul_precision)
        self._saved_cache = compile_cache.use(self.compile_cache)
        runtime.close_before_jax_exits(close_session)
        if self.xla is not None:
            runtime.local.alive = self.alive
            distributed.Distributed(self.xla["address"], self.n, self.process_id(rank), self.xla.get("timeout")).start()

    def release_master(self):
        runtime.set_precision(getattr(self, "_saved_precision", None))
        compile_cache.restore(self._saved_cache)
        self._saved_cache = None
        distributed.stop_distributed()
        runtime.local.alive = None
        if self._limits is not None:
            self._limits.release()
            self._limits = None
        self._saved_env = restore_env(self._saved_env)

    def init_worker(self, rank):
        if self.floatX:
            import pytensor
            if pytensor.config.floatX != self.floatX:      # JAX's x64 mode follows floatX
                pytensor.config.floatX = self.floatX
        runtime.configure(self.platform, None, gloo=self.xla is not None, precision=self.matmul_precision)
        compile_cache.use(self.compile_cache)
        if self.xla is not None:
            master_pid = self.xla["master_pid"]

            def alive():
                if os.getppid() != master_pid:
                    raise MasterDied("master process is gone")
            runtime.local.alive = alive
            d = distributed.Distributed(self.xla["address"], self.n, self.process_id(rank), self.xla.get("timeout"))
            d.start()
            d.wait_connected(alive)    # (its backend starts meanwhile, with the master's: see _Distributed)
        else:
            runtime.ensure()

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
        runtime.ensure()
        from .held import held
        from .host_ops import holds_host_ops, stretched
        from .ops import declared

        outputs = declared(outputs)
        inputs, givens, gens = generators.explicit(inputs, outputs, givens)
        given = list(givens.values()) if isinstance(givens, dict) else [v for _, v in (givens or [])]
        if holds_host_ops((list(outputs) if isinstance(outputs, list) else [outputs]) + given):
            mode = stretched(mode)          # in-graph collectives: jitted stretches between them
        else:
            mode = held(mode)               # a Ctrl-C during the dispatch stays a KeyboardInterrupt
        with compiling():
            fn = pytensor.function(inputs, outputs, givens=givens, mode=mode, **kwargs)
        if gens:
            fn = generators.DrawingFunction(fn, gens)
        return self.adopt(fn)

    def adopt(self, fn):
        runtime.ensure()
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
        elif isinstance(value, np.random.Generator):
            value = storage[0] = generators.as_jax(value)     # what JAX draws from
        return value

    def set(self, var, value):
        if isinstance(value, (dict, np.random.Generator)):    # a random generator's
            value = generators.as_jax(value)
        elif not is_device_array(value):
            value = to_device(value)
        var.container.storage[0] = value

    def generator_state(self, var):
        return generators.state_of(self.get(var))

    def set_generator_state(self, var, state):
        var.container.storage[0] = generators.from_state(state)

    def to_host(self, arr):
        return to_host(arr)

    def to_device(self, arr):
        return to_device(arr)

    def read_into(self, arr, out):
        read_into(arr, out)

    def call_inputs(self, arrays):
        out, moved = call_arrays(arrays)
        if runtime.local.gpu:
            self._inflight.extend(moved)   # (waited for with the call's outputs)
        return out

    def combine(self, mode, parts, weights=None):
        if mode is None or len(parts) == 1:
            return parts[-1] if mode is None else parts[0]
        if mode == "gather":
            import jax.numpy as jnp
            return jnp.concatenate(parts, axis=0) if parts[0].ndim else jnp.stack(parts)
        w = np.ones(len(parts)) if weights is None else np.asarray(weights, np.float64)
        parts = [to_device(p) for p in parts]
        return _combine_fn(mode, parts[0].dtype, len(parts))(tuple(parts), to_device(w))

    def wait(self, arrays, reads=0):
        import jax
        inflight, self._inflight = self._inflight, []
        if not arrays and not inflight:
            return
        if reads and runtime.local.gpu:
            start_reads(arrays[:reads])  # (queued behind the computation: its read waits no more)
        jax.block_until_ready(list(arrays) + inflight)   # an XLA error surfaces here (reading a failed
        #                                                   buffer hangs: JAX 0.12 CPU, measured)

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
            stats = runtime.ensure().memory_stats()     # None on the CPU
        except Exception:
            pass
        where = f"GPU {self.gpus[rank]}" if self.platform == "gpu" and self.gpus else "JAX CPU device"
        return DeviceMemoryError(rank, where, what, detail, _sizes(inputs), stats)

    def describe(self):
        adds = ""
        if self.reduce_on_device and self.n > 1:
            adds = ", all_reduce adding on the device" + (" from 1 MB" if self.reduce_on_device == "large" else "")
        if self.platform == "gpu":
            comm = "NCCL (XLA collectives)" if self.xla else f"host-staged collectives{adds}"
            return (f"{self.n} GPU rank(s) (GPU {', '.join(self.gpus)}), PyTensor JAX backend, {comm}"
                    f"{runtime.precision_note(self.matmul_precision)}")
        comm = "XLA gloo collectives" if self.xla else f"shared-memory collectives{adds}"
        if self.local_n != self.n:         # (under mpiexec: this host's ranks share its cores)
            return (f"{self.n} JAX CPU rank(s), {self.local_n} on this host's {self.cores} usable cores, "
                    f"{self.threads} thread(s) each, shared-memory collectives on each host, MPI between hosts")
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


