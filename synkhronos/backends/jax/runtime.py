"""This process's JAX: its configuration before JAX's backends start, the one device it
computes on (``ensure``), and its exit.

PyTensor's JAX backend sets JAX's x64 mode from ``floatX`` when it is first imported:
``configure`` imports it, so that every process has the same mode before its first array.
The master registers a close of its session to run before JAX's own exit handler."""
import sys


class LocalJax:
    """The JAX device this process computes on (one per process, whatever the session)."""

    def __init__(self):
        self.dev = None            # jax Device
        self.sharding = None
        self.gpu = False
        self.dist = None           # _Distributed while jax.distributed is up
        self.alive = None          # raises when the other processes' side is gone (while waiting)


local = LocalJax()


def jax_started():
    """Whether JAX's backends are initialised in this process (without importing JAX)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except Exception:
        return True


def current_precision():
    """JAX's float32 matmul precision in this process (None: JAX's default), without
    importing JAX when it is not imported yet (then: its environment variable)."""
    if "jax" not in sys.modules:
        import os
        return os.environ.get("JAX_DEFAULT_MATMUL_PRECISION") or None
    import jax
    return jax.config.jax_default_matmul_precision or None


def set_precision(precision):
    if "jax" in sys.modules or precision is not None:
        import jax
        jax.config.update("jax_default_matmul_precision", precision)


def precision_note(precision):
    """For the fork banner: what float32 matmuls are on this process's GPU."""
    if precision not in (None, "default", "bfloat16", "tensorfloat32"):
        return f", float32 matmuls at precision {precision!r}"
    try:
        cc = float(getattr(ensure(), "compute_capability", 0) or 0)
    except Exception:
        cc = 0.0
    if precision == "bfloat16":
        return ", float32 matmuls in bfloat16 (matmul_precision='bfloat16')"
    if cc >= 8.0 or precision == "tensorfloat32":
        return (", float32 matmuls run as TF32 (JAX's default on this GPU; "
                "synk.fork(matmul_precision='highest') for full float32)")
    return ""


def configure(platform, gpu=None, gloo=False, precision=None):
    """JAX's configuration for this process, before its backends start (later: no effect
    but for the matmul precision, which applies to later compiles).
    PyTensor's JAX backend sets JAX's x64 mode from ``floatX`` when it is first imported:
    imported here, so that every process has the same mode before its first array."""
    import jax
    import pytensor.link.jax.dispatch  # noqa: F401
    from . import conversions
    conversions.register()
    if precision is not None:
        jax.config.update("jax_default_matmul_precision", precision)
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


def ensure():
    """This process's JAX device (starts JAX's backend on first use)."""
    if local.dev is None:
        dist = local.dist
        if dist is not None:
            dist.wait_ready(local.alive)
        import jax
        from jax.sharding import SingleDeviceSharding
        dev = jax.local_devices()[0]
        jax.config.update("jax_default_device", dev)
        local.sharding = SingleDeviceSharding(dev)
        local.gpu = dev.platform != "cpu"
        local.dev = dev
        if local.gpu:                   # shared memory page-locked for this GPU's copies
            from . import pinning
            pinning.install(getattr(dev, "local_hardware_id", 0) or 0)
    return local.dev


_atexit_done = False


def close_before_jax_exits(close_session):
    """At exit, ``close_session()`` before JAX's own exit handler (registered when JAX was
    imported, so it would run first) clears the backends and leaves jax.distributed under
    the running workers."""
    global _atexit_done
    if _atexit_done:
        return
    import atexit
    atexit.register(close_session)
    _atexit_done = True


def warn_started_master(gpu):
    print(f"synkhronos: warning: JAX was already started in this process before synk.fork(); the master "
          f"cannot pin itself to GPU {gpu} and uses JAX's default device (call synk.fork() before any "
          "JAX use)", file=sys.stderr, flush=True)
