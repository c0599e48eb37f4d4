"""synkhronos.progress.busy: silent for fast blocks; plain lines off a terminal; a spinner
line in a terminal; always cleans up its thread; never raises on a dead stream; off with
SYNK_PROGRESS=0."""
import io
import threading
import time

import pytest

from synkhronos.progress import busy, enabled


class TTY(io.StringIO):
    def isatty(self):
        return True


class Closing(io.StringIO):
    """A stream that is closed after ``n`` writes."""

    def __init__(self, n):
        super().__init__()
        self.n = n

    def write(self, s):
        self.n -= 1
        if self.n < 0:
            self.close()
        return super().write(s)


class ClosingTTY(Closing):
    def isatty(self):
        return True


def progress_threads():
    return [t for t in threading.enumerate() if t.name == "synk-progress"]


@pytest.fixture(autouse=True)
def _env_and_threads(monkeypatch):
    monkeypatch.delenv("SYNK_PROGRESS", raising=False)
    yield
    deadline = time.monotonic() + 3
    while progress_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not progress_threads(), "a progress thread outlived its block"


@pytest.mark.parametrize("stream_cls", [io.StringIO, TTY])
def test_fast_block_prints_nothing(stream_cls):
    s = stream_cls()
    with busy("synkhronos: compiling f (numba JIT)", stream=s, min_seconds=0.5) as b:
        time.sleep(0.05)
    assert s.getvalue() == ""
    assert b.slow is False
    assert not progress_threads()


def test_plain_lines_when_not_a_terminal():
    s = io.StringIO()
    with busy("synkhronos: compiling f (numba JIT)", stream=s, min_seconds=0.05, every=0.2) as b:
        time.sleep(0.55)
    out = s.getvalue()
    assert "\r" not in out
    lines = out.splitlines()
    assert lines[0] == "synkhronos: compiling f (numba JIT) ..."
    still = [ln for ln in lines if "still running" in ln]
    assert 1 <= len(still) <= 3, out           # one every 0.2 s after the first at 0.05 s
    assert all(ln.startswith("synkhronos: compiling f (numba JIT) ... still running, ")
               and ln.endswith(" s") for ln in still)
    assert lines[-1].startswith("synkhronos: compiling f (numba JIT) ... done in ")
    assert lines[-1].endswith(" s")
    assert float(lines[-1].split("done in ")[1][:-2]) == pytest.approx(0.55, abs=0.3)
    assert b.slow and b.elapsed >= 0.55


def test_spinner_line_in_a_terminal():
    s = TTY()
    with busy("compiling g", stream=s, min_seconds=0.05, tick=0.02):
        time.sleep(0.4)
    out = s.getvalue()
    assert out.endswith("\n") and out.count("\n") == 1      # one line, rewritten in place
    frames = out.split("\r")[1:]
    assert len(frames) >= 5, out                              # updated several times
    assert {f[0] for f in frames[:-1]} > {"|"}                # the spinner turns
    assert all("compiling g ... " in f for f in frames)
    assert frames[-1].rstrip().startswith("compiling g ... done in ")
    # every frame covers the previous one (no stale characters left at the end)
    assert all(len(b) >= len(a.rstrip()) for a, b in zip(frames, frames[1:]))


def test_exception_propagates_and_says_failed():
    s = io.StringIO()
    with pytest.raises(ValueError, match="boom"):
        with busy("work", stream=s, min_seconds=0.02):
            time.sleep(0.1)
            raise ValueError("boom")
    assert s.getvalue().splitlines()[-1].startswith("work ... failed after ")
    assert not progress_threads()


def test_keyboard_interrupt_cleans_up():
    s = TTY()
    with pytest.raises(KeyboardInterrupt):
        with busy("work", stream=s, min_seconds=0.02, tick=0.01):
            time.sleep(0.1)
            raise KeyboardInterrupt
    assert "interrupted after" in s.getvalue().split("\r")[-1]
    assert not progress_threads()


def test_fast_exception_prints_nothing():
    s = io.StringIO()
    with pytest.raises(RuntimeError):
        with busy("work", stream=s, min_seconds=1.0):
            raise RuntimeError("fast")
    assert s.getvalue() == ""


@pytest.mark.parametrize("stream_cls", [io.StringIO, TTY])
def test_closed_stream_is_harmless(stream_cls):
    s = stream_cls()
    s.close()
    with busy("work", stream=s, min_seconds=0.02, every=0.05, tick=0.01):
        time.sleep(0.15)
    s2 = Closing(1) if stream_cls is io.StringIO else ClosingTTY(1)
    with busy("work", stream=s2, min_seconds=0.02, every=0.05, tick=0.01):
        time.sleep(0.15)                  # closed in the middle of the display


@pytest.mark.parametrize("value", ["0", "false", "off"])
def test_disabled_by_environment(monkeypatch, value):
    monkeypatch.setenv("SYNK_PROGRESS", value)
    assert not enabled()
    s = TTY()
    with busy("work", stream=s, min_seconds=0.01, tick=0.01):
        time.sleep(0.1)
    assert s.getvalue() == ""
    assert not progress_threads()


def test_enabled_by_default_and_with_1(monkeypatch):
    assert enabled()
    monkeypatch.setenv("SYNK_PROGRESS", "1")
    assert enabled()


def test_nested_blocks_show_only_the_outer_one():
    s = io.StringIO()
    with busy("outer", stream=s, min_seconds=0.02, every=10):
        with busy("inner", stream=s, min_seconds=0.01, every=10):
            time.sleep(0.1)
    out = s.getvalue()
    assert "inner" not in out and out.startswith("outer ...\n"), out
    assert len(progress_threads()) == 0


def test_default_stream_is_stderr(capsys):
    with busy("to stderr", min_seconds=0.02, every=10):
        time.sleep(0.1)
    cap = capsys.readouterr()
    assert cap.out == ""
    assert cap.err.startswith("to stderr ...\n") and "done in" in cap.err
