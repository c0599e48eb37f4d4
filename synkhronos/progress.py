"""Show that a long call is alive: e.g. the first call of a function, which JIT-compiles it
with numba (30-80 s on a cold cache).  Dependency-free.

    from synkhronos.progress import busy

    with busy("synkhronos: compiling f (numba JIT)"):
        f(x)

Nothing is printed unless the block is still running after ``min_seconds`` (2 s by
default).  Then, on ``stream`` (``sys.stderr`` by default):

* in a terminal (``stream.isatty()``): one line, rewritten about 4 times a second from a
  daemon thread, with a spinner and the seconds elapsed::

      / synkhronos: compiling f (numba JIT) ... 12 s

* otherwise (a log file, a pipe, a CI console): plain lines, one when the block turns out
  slow and one every ``every`` seconds (15) after that::

      synkhronos: compiling f (numba JIT) ...
      synkhronos: compiling f (numba JIT) ... still running, 15 s

and when the block ends (only if something was printed)::

      synkhronos: compiling f (numba JIT) ... done in 41.2 s

(``failed after``/``interrupted after`` when it ends with an exception, which propagates
unchanged).  The thread is stopped and joined when the block ends, however it ends
(``KeyboardInterrupt`` included).  Writing never raises: a closed or broken stream just
silences the display.  Nested ``busy`` blocks in one thread show only the outermost.
``SYNK_PROGRESS=0`` (or ``false``, ``no``, ``off``) in the environment turns it off.
"""
import os
import sys
import threading
import time

__all__ = ["busy", "Busy", "enabled"]

_SPINNER = "|/-\\"
_OFF = ("0", "false", "no", "off")
_local = threading.local()          # per-thread nesting depth


def enabled():
    """False when the environment says ``SYNK_PROGRESS=0`` (or false/no/off)."""
    return os.environ.get("SYNK_PROGRESS", "1").strip().lower() not in _OFF


def _isatty(stream):
    try:
        return bool(stream.isatty())
    except Exception:               # closed (ValueError), or no isatty at all
        return False


class Busy:
    """The context manager returned by :func:`busy` (see the module's documentation).

    After the block, ``slow`` says whether anything was shown and ``elapsed`` how long the
    block took (seconds; None if the display was off)."""

    def __init__(self, message, stream=None, min_seconds=2.0, every=15.0, tick=0.25):
        self.message = str(message)
        self.min_seconds = max(0.0, float(min_seconds))
        self.every = max(0.01, float(every))
        self.tick = max(0.01, float(tick))
        self._stream_arg = stream
        self.slow = False
        self.elapsed = None
        self._thread = None
        self._active = False
        self._nested = False

    # --- writing (never raises) ------------------------------------------------------------

    def _write(self, text):
        if self._dead:
            return
        try:
            self._stream.write(text)
            self._stream.flush()
        except Exception:           # closed, broken pipe, ...: stop showing anything
            self._dead = True

    def _tty_line(self, text):
        pad = max(0, self._width - len(text))
        self._width = len(text)
        self._write("\r" + text + " " * pad)

    # --- the display thread ---------------------------------------------------------------

    def _run(self):
        if self._stop.wait(self.min_seconds):
            return                                   # fast block: nothing at all
        with self._lock:
            if self._stop.is_set():
                return
            self.slow = True
            if self._tty:
                self._tty_line(f"{_SPINNER[0]} {self.message} ... {self._since():.0f} s")
            else:
                self._write(f"{self.message} ...\n")
        k, next_line = 0, self.every
        while not self._stop.wait(self.tick if self._tty else
                                  max(0.0, next_line - self._since())):
            with self._lock:
                if self._stop.is_set():
                    return
                if self._tty:
                    k += 1
                    self._tty_line(f"{_SPINNER[k % len(_SPINNER)]} {self.message} ... "
                                   f"{self._since():.0f} s")
                elif self._since() >= next_line:
                    self._write(f"{self.message} ... still running, {self._since():.0f} s\n")
                    next_line += self.every

    def _since(self):
        return time.monotonic() - self._t0

    # --- context manager ------------------------------------------------------------------

    def __enter__(self):
        depth = getattr(_local, "depth", 0)
        _local.depth = depth + 1
        self._active = True
        self._nested = depth > 0
        if self._nested or not enabled():
            return self
        self._stream = self._stream_arg if self._stream_arg is not None else sys.stderr
        self._dead = self._stream is None
        self._tty = _isatty(self._stream)
        self._width = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="synk-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self._active:
            return False
        self._active = False
        _local.depth = max(0, getattr(_local, "depth", 1) - 1)
        thread, self._thread = self._thread, None
        if thread is None:
            return False
        self.elapsed = self._since()
        self._stop.set()
        try:
            thread.join(timeout=2.0)     # it only waits on the event; a stuck write is the
        finally:                         # only way it could outlive this (daemon: harmless)
            if self.slow and self._lock.acquire(timeout=1.0):
                try:
                    if exc_type is None:
                        end = f"done in {self.elapsed:.1f} s"
                    elif issubclass(exc_type, KeyboardInterrupt):
                        end = f"interrupted after {self.elapsed:.1f} s"
                    else:
                        end = f"failed after {self.elapsed:.1f} s"
                    if self._tty:
                        self._tty_line(f"{self.message} ... {end}")
                        self._write("\n")
                    else:
                        self._write(f"{self.message} ... {end}\n")
                finally:
                    self._lock.release()
        return False


def busy(message, stream=None, min_seconds=2.0, every=15.0, tick=0.25):
    """Context manager: show ``message`` with the elapsed time if the block takes longer than
    ``min_seconds``; a spinner line in a terminal, plain lines (every ``every`` seconds)
    otherwise.  See the module's documentation."""
    return Busy(message, stream=stream, min_seconds=min_seconds, every=every, tick=tick)
