"""What a demo shows while it runs, on stderr: the progress of its loops (a tqdm bar when
stderr is a terminal, otherwise a plain line every ``LINE_EVERY`` seconds of a long loop:
no carriage returns in logs and pipes; ``--no-progress``: nothing) and a line that shows
a long first call (the JIT) is alive."""
import contextlib
import sys
import time

LINE_EVERY = 10.0      # seconds between plain progress lines (stderr not a terminal)


def _isatty(stream):
    try:
        return bool(stream.isatty())
    except Exception:
        return False


def progress_mode(no_progress, stream=None):
    """``"off"``, ``"bar"`` (tqdm: ``stream`` is a terminal) or ``"lines"`` (plain lines)."""
    if no_progress:
        return "off"
    return "bar" if _isatty(sys.stderr if stream is None else stream) else "lines"


class Progress:
    """Progress of one loop of ``total`` steps on stderr: a tqdm bar (``mode="bar"``), a
    plain line every ``every`` seconds while the loop runs (``"lines"``: no carriage
    returns in logs and pipes), or nothing (``"off"``)."""

    def __init__(self, total, desc, mode, every=LINE_EVERY, stream=None):
        self.total, self.desc, self.mode, self.every = total, desc, mode, every
        self.stream = sys.stderr if stream is None else stream
        self.k = 0
        self.t0 = self.t_last = time.perf_counter()
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True,
                            file=self.stream)

    def step(self, loss=None):
        self.k += 1
        if self.bar is not None:
            self.bar.update(1)
            if loss is not None and self.k % 5 == 0:
                self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        elif self.mode == "lines":
            now = time.perf_counter()
            if now - self.t_last >= self.every and self.k < self.total:
                self.t_last = now
                tail = "" if loss is None else f", loss {loss:.4f}"
                try:
                    print(f"  {self.desc}: step {self.k}/{self.total}, {now - self.t0:.0f} s{tail}",
                          file=self.stream, flush=True)
                except (OSError, ValueError):
                    self.mode = "off"

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def busy_display(message, enabled):
    """``synkhronos.progress.busy`` (a line that shows a long first call is alive), or
    nothing."""
    if not enabled:
        return contextlib.nullcontext()
    from synkhronos.progress import busy
    return busy(message)

