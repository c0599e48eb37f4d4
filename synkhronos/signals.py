"""Signals: windows that a signal must not split, and interrupts that must stay interrupts."""
import signal
import threading
from contextlib import contextmanager

_SYNCHRONOUS = {getattr(signal, n) for n in ("SIGKILL", "SIGSTOP", "SIGSEGV", "SIGBUS", "SIGFPE",
                                              "SIGILL", "SIGTRAP", "SIGSYS", "SIGABRT") if hasattr(signal, n)}
_DEFERRABLE = set(signal.valid_signals()) - _SYNCHRONOUS


@contextmanager
def deferred():
    """Hold asynchronous signals (Ctrl-C, SIGTERM, timers …) until the block ends, so that
    a decision and the bookkeeping that records it happen together or not at all."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _DEFERRABLE)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


_state = threading.local()


def hold():
    """Hold asynchronous signals from now until ``release()`` (the end of the command
    scope): once a rank has committed to a change, the master finishes applying it."""
    if getattr(_state, "old", None) is None:
        _state.old = signal.pthread_sigmask(signal.SIG_BLOCK, _DEFERRABLE)


def release():
    old = getattr(_state, "old", None)
    if old is not None:
        _state.old = None
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


@contextmanager
def command_scope():
    """Signals held by ``hold()`` inside the block are delivered when it ends."""
    try:
        yield
    finally:
        release()


def as_interrupt(exc):
    """The KeyboardInterrupt or SystemExit hidden in ``exc``, else None.

    Compiled code (numba) that is interrupted by a signal whose handler raised reports
    ``SystemError: ... returned a result with an exception set`` with the handler's
    exception as its context; a training loop's ``except KeyboardInterrupt`` would miss it."""
    seen = 0
    e = exc
    while e is not None and seen < 8:
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            return e
        if not isinstance(e, SystemError):
            return None
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def restore_interrupt(exc):
    """Raise the interrupt hidden in ``exc`` (chained from it) if there is one."""
    inner = as_interrupt(exc)
    if inner is not None and inner is not exc:
        raise type(inner)(*inner.args) from exc
