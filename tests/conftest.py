"""Shared fixtures: every test module must leave no shared memory and no worker behind.

Each runtime's shared-memory names start with a random session prefix; we record every
prefix made in this process (by wrapping ``synkhronos.shm.new_prefix``) so that the leak
check looks only at our own entries, not at those of another run on the same machine."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import synkhronos  # noqa: E402
from synkhronos import shm as _shm  # noqa: E402

import synk_testutil as tu  # noqa: E402

_orig_new_prefix = _shm.new_prefix


def _recording_new_prefix():
    p = _orig_new_prefix()
    tu.PREFIXES.append(p)
    return p


_shm.new_prefix = _recording_new_prefix


def _close_quietly():
    try:
        synkhronos.close()
    except Exception:  # pragma: no cover - best effort after a failed test
        pass


@pytest.fixture(scope="module", autouse=True)
def no_leaks_after_module():
    """After the module (and its fork fixtures) is done: no /dev/shm entry of any session
    started in it, no ``synkhronos.worker`` child process, no open runtime."""
    first = len(tu.PREFIXES)
    yield
    rt = tu.runtime()
    still_open = rt is not None and not rt.closed
    if still_open:
        _close_quietly()
    prefixes = tu.PREFIXES[first:]
    # close() is synchronous; the short wait only covers a worker that is exiting on its own
    tu.wait_until(lambda: not tu.entries_of(prefixes), 5.0)
    left = tu.entries_of(prefixes)
    tu.wait_until(lambda: not tu.worker_children(), 5.0)
    procs = tu.worker_children()
    problems = []
    if still_open:
        problems.append("a synkhronos runtime was left open by the module")
    if left:
        problems.append(f"shared-memory entries left in /dev/shm: {left}")
    if procs:
        problems.append(f"synkhronos.worker processes left running: {procs}")
        for pid in procs:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
    for p in prefixes:
        _shm.remove_all(p)
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


@pytest.fixture
def assert_clean():
    """Function-level check for tests that fork and close their own sessions."""
    first = len(tu.PREFIXES)

    def check():
        prefixes = tu.PREFIXES[first:]
        assert tu.entries_of(prefixes) == []
        assert tu.worker_children() == []
    return check
