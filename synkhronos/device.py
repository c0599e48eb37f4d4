"""The device plane: what one rank computes on.

A device says how many of its kind a machine has, how a worker process of a rank must be
started (its environment), how functions are compiled for it, where a shared variable's
value lives (``get``/``set`` its storage, without copies) and how arrays move between the
host and the device.  ``placement`` ("host" or "device") tells the comm plane where arrays
live.

Implementations (wired by ``synkhronos.backends``, which also picks one for ``fork()``):
``cpu`` (``backends.host.device``: CPU cores, PyTensor's default backend, numba) and
``jax`` (``backends.jax.device``: PyTensor's JAX backend, one GPU per rank or the CPU)."""
from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable


@runtime_checkable
class Device(Protocol):
    """A device, bound to one rank's process."""

    kind: str                 # the registry name (``config()["kind"]``)
    placement: str            # "host": numpy arrays; "device": arrays of the device
    n: int                    # ranks of the session

    @staticmethod
    def count() -> int:
        """Number of devices of this kind on the machine (0 if none)."""

    def config(self) -> dict:
        """What a worker needs to rebuild this device (json-able; ``kind`` names it)."""

    # ---- processes -------------------------------------------------------------------------
    def worker_env(self, rank: int) -> dict:
        """Environment variables a worker process of ``rank`` starts with."""

    def init_master(self, rank: int, close_session: Callable[[], Any]) -> None:
        """Prepare the master process to act as ``rank``; undone by ``release_master``.
        ``close_session``: closes the session (for a device whose runtime must see the
        session closed before its own exit handlers run)."""

    def release_master(self) -> None:
        """Undo ``init_master``."""

    def init_worker(self, rank: int) -> None:
        """Prepare a freshly started worker process."""

    # ---- compiling -------------------------------------------------------------------------
    def compile(self, inputs, outputs, givens=None, **kwargs) -> Any:
        """A PyTensor function for this device that trusts its inputs (they are checked by
        synkhronos in the master)."""

    def adopt(self, fn) -> Any:
        """Prepare a function unpickled in a worker."""

    # ---- values ----------------------------------------------------------------------------
    def get(self, var) -> Any:
        """The value a shared variable holds on this rank, where it lives (no copy)."""

    def set(self, var, value) -> None:
        """Make ``value`` (an array of this device) the shared variable's value (no copy)."""

    def generator_state(self, var) -> dict:
        """The JSON state (``synkhronos.generators``) of the random generator that the
        ``RandomType`` shared variable ``var`` holds on this rank."""

    def set_generator_state(self, var, state: dict) -> None:
        """Make ``var``'s generator on this rank continue from ``state`` (a
        ``generator_state`` of any device; one this device cannot continue starts the
        stream ``generators.derived`` makes of it).  ValueError if it is not a state."""

    def to_host(self, arr) -> Any:
        """A numpy array of ``arr`` (a view where possible)."""

    def to_device(self, arr) -> Any:
        """``arr`` as an array of this device.  A device that keeps arrays on itself
        (``placement == "device"``) copies: host memory it came from may be reused at once.
        A host device returns ``arr`` itself (no copy: a caller that keeps it keeps the
        memory)."""

    def call_inputs(self, arrays: Sequence) -> list:
        """A call's inputs as its compiled function takes them: on this device, like
        ``to_device`` each, but moved together and without waiting (small host arrays may
        stay private host copies that the function's own dispatch moves, as a plain call
        does): the host memory they came from stays untouched until the call's ``wait``,
        which also waits for these transfers (no synchronisation a plain call does not have)."""

    def wait(self, arrays: Sequence, reads: int = 0) -> None:
        """Block until ``arrays`` are computed, and the transfers of ``call_inputs`` since the
        last wait are done; raises here if their computation failed (a device that computes
        asynchronously), before anything is kept or sent.  The first ``reads`` of them are
        read next (``to_host``): a device may start copying them to the host now."""

    def explain(self, exc: BaseException, rank: int, what: str, inputs: Sequence) -> Optional[BaseException]:
        """A clearer exception for ``exc`` (raised by this device while rank ``rank``
        computed ``what`` on ``inputs``), or None to raise ``exc`` as it is."""

    def combine(self, mode: str, parts: Sequence, weights=None) -> Any:
        """``reductions.combine`` of arrays of this device, into an array of this device (a
        call's ``num_slices`` partial updates)."""

    def describe(self) -> str:
        """One line for the fork banner."""
