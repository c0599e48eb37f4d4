"""Jitted calls that a Ctrl-C cannot turn into another error.

A signal's Python handler runs at the interpreter's next check, wherever that is; during a
jitted call's dispatch that can be Python code that jaxlib's C++ calls back (the cache-key
comparison of a call that traces), and jaxlib reports the handler's ``KeyboardInterrupt``
as ``ValueError: Cache keys should be comparable ...`` with no cause attached: the user's
``except KeyboardInterrupt`` misses it.  Every jitted call of a JAX session therefore
dispatches inside a signal window (``synkhronos.signals.deferred``): the interrupt lands
as itself right after the dispatch.  Only the dispatch is held (JAX computes
asynchronously); waiting for the values stays interruptible."""
import numpy as np
from pytensor.link.jax.linker import JAXLinker

from .transfers import host_transfers_guarded, put_scope
from ...signals import deferred


class Held:
    """A jitted callable dispatched inside a signal window; host arguments (small call
    inputs: ``transfers.call_arrays``) are transferred by the dispatch as explicit
    transfers (where a transfer guard could refuse them: the scope costs time)."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        with deferred():
            scope = put_scope() if any(type(a) is np.ndarray for a in args) and host_transfers_guarded() else None
            if scope is None:
                return self.fn(*args)
            with scope():
                return self.fn(*args)


class HeldJAXLinker(JAXLinker):
    """PyTensor's JAX linker whose compiled graph is dispatched as a ``Held`` call."""

    def jit_compile(self, fn):
        return Held(super().jit_compile(fn))


def held(mode):
    """``mode`` (a JAX mode or its name) with ``HeldJAXLinker`` when its linker is
    PyTensor's own; another linker is kept as given."""
    from pytensor.compile.mode import Mode, get_mode
    m = get_mode(mode)
    if type(m.linker) is not JAXLinker:
        return m
    return Mode(linker=HeldJAXLinker(), optimizer=m.provided_optimizer)
