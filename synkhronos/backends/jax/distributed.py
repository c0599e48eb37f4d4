"""``jax.distributed`` for XLA's multi-process collectives (NCCL on GPUs, gloo on the CPU).

Set up as JAX's own ``initialize`` does, except that the client's error callback records
errors instead of terminating the process (a lost rank must end in ``WorkerDied``, not end
the master), and that a thread connects and then starts JAX's backend while the main
thread goes on watching the other ranks.  The master hosts the coordination service on a
loopback port it picks (``free_port``), as process 0."""
import os
import socket
import threading

from .runtime import local

HEARTBEAT_S = 100            # jax.distributed heartbeat timeout (SYNK_JAX_HEARTBEAT; a lost rank is noticed
                             # earlier by the launcher's liveness checks)


class Distributed:
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
        hb = heartbeat()
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
        local.dist = self
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
        if local.dist is self:
            local.dist = None
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


def heartbeat():
    raw = os.environ.get("SYNK_JAX_HEARTBEAT", "").strip()
    try:
        return max(1, int(float(raw))) if raw else HEARTBEAT_S
    except ValueError:
        raise ValueError(f"SYNK_JAX_HEARTBEAT={raw!r} must be a number of seconds") from None


def stop_distributed():
    """Leave ``jax.distributed`` (a worker at quit; the master once its workers are gone)."""
    dist = local.dist
    if dist is not None:
        dist.stop()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
