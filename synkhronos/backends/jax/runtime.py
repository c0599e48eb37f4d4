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


def configure(platform, gpu=None, gloo=False):
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
