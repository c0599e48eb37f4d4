"""Shared fixtures: every test module must leave no shared memory and no worker behind.

Each session's shared-memory names start with a random prefix; synkhronos appends every
new prefix to the file named by ``SYNK_PREFIX_LOG`` (set up by ``synk_testutil``), so the
leak checks look only at this run's own entries, not at those of another program."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import synk_testutil as tu  # noqa: E402  (sets SYNK_PREFIX_LOG before any session)
import synkhronos  # noqa: E402


def _close_quietly():
    try:
        synkhronos.close()
    except Exception:  # pragma: no cover - best effort after a failed test
        pass


@pytest.fixture(scope="module", autouse=True)
def no_leaks_after_module():
    """After the module (and its fork fixtures) is done: no /dev/shm entry of any session
    started in it, no ``synkhronos.worker`` child process, no open runtime."""
    first = len(tu.prefixes())
    yield
    still_open = tu.is_open()
    if still_open:
        _close_quietly()
    prefixes = tu.prefixes()[first:]
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
        tu.remove_all(p)
    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


@pytest.fixture
def assert_clean():
    """Function-level check for tests that fork and close their own sessions."""
    first = len(tu.prefixes())

    def check():
        prefixes = tu.prefixes()[first:]
        assert tu.entries_of(prefixes) == []
        assert tu.worker_children() == []
    return check
