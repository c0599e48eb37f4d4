"""Signals: windows that a signal must not split, and interrupts that must stay interrupts.

Python runs a signal's handler in the main thread at its next check of the interpreter,
whichever thread the OS delivered the signal to (a Ctrl-C from a terminal goes to the whole
process; any thread may take it), so blocking signals in one thread cannot stop a handler
from raising in the middle of a decision.  Instead, while a window is held, the Python
handlers of the signals that interrupt programs (``WATCHED``) only record the signal; the
recorded handlers run, and may raise, when the window ends."""
import signal
import threading

try:
    from _signal import getsignal as _getsignal       # the C function: no enum conversion
except ImportError:       # pragma: no cover
    _getsignal = signal.getsignal

WATCHED = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGALRM", "SIGUSR1", "SIGUSR2",
                                             "SIGVTALRM") if hasattr(signal, n))
_main = threading.main_thread()
_depth = 0           # windows open in the main thread
_pending = []        # (handler, signum) recorded while a window was open
_state = threading.local()


class _Deferring:
    """A Python signal handler that waits while a window is open."""

    __slots__ = ("inner",)

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, signum, frame):
        if _depth:
            _pending.append((self.inner, signum))
            return None
        return self.inner(signum, frame)


def _wrap():
    for sig in WATCHED:
        h = _getsignal(sig)
        if callable(h) and not isinstance(h, _Deferring):
            signal.signal(sig, _Deferring(h))


def unwrap():
    """Give back the handlers as they were (the session closes)."""
    if threading.current_thread() is not _main:
        return
    for sig in WATCHED:
        h = _getsignal(sig)
        if isinstance(h, _Deferring):
            signal.signal(sig, h.inner)


def _open():
    """Open a window; False when there is nothing to hold (not the main thread, whose
    handlers never interrupt this thread)."""
    global _depth
    if threading.current_thread() is not _main:
        return False
    _wrap()
    _depth += 1
    return True


def _close():
    global _depth
    _depth -= 1
    if _depth == 0 and _pending:
        todo = list(_pending)
        _pending.clear()
        for inner, signum in todo:       # may raise: the window is over
            if callable(inner):
                inner(signum, None)


class deferred:
    """A window: signals that arrive inside the block are handled when it ends, so that a
    decision and the bookkeeping that records it happen together or not at all."""

    __slots__ = ("on",)

    def __enter__(self):
        self.on = _open()
        return self

    def __exit__(self, *exc):
        if self.on:
            _close()


def hold():
    """Open a window until ``release()`` (the end of the command): once a rank has
    committed to a change, the master finishes applying it before an interrupt lands."""
    if not getattr(_state, "held", False):
        _state.held = _open()


def release():
    if getattr(_state, "held", False):
        _state.held = False
        _close()


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
