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
    started in it, no ``synkhronos.worker`` or guardian child process, no open runtime."""
    first = len(tu.prefixes())
    yield
    still_open = tu.is_open()
    if still_open:
        _close_quietly()
    prefixes = tu.prefixes()[first:]
    # close() is synchronous; the short wait only covers a worker that is exiting on its own
    tu.wait_until(lambda: not tu.entries_of(prefixes), 5.0)
    left = tu.entries_of(prefixes)
    tu.wait_until(lambda: not tu.worker_children() and not tu.guardians(), 5.0)
    procs = tu.worker_children() + tu.guardians()
    problems = []
    if still_open:
        problems.append("a synkhronos runtime was left open by the module")
    if left:
        problems.append(f"shared-memory entries left in /dev/shm: {left}")
    if procs:
        problems.append(f"synkhronos worker or guardian processes left running: {procs}")
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
        assert tu.worker_children() == [] and tu.guardians() == []
    return check


# ---- the functional suite on PyTensor's JAX backend ----------------------------------------------
# scripts/test.sh runs the modules below a second time with SYNK_MODE=JAX (``-m functional``):
# every session they fork then runs PyTensor's JAX backend on CPU ranks.  Tests that cannot
# hold there are skipped under JAX, each with its reason.

FUNCTIONAL_MODULES = ("test_function_outputs", "test_collectives", "test_batching", "test_batching_sliceable",
                      "test_batching_bad_calls", "test_intro_example",
                      "test_shared_example", "test_updates", "test_data", "test_exchange", "test_ops",
                      "test_checkpoint", "test_sharded_updates", "test_sharded_faults", "test_random_streams",
                      "test_elastic", "test_one_rank", "test_close_memory", "test_eager_all_reduce",
                      "test_serial_turns")
# tests of those modules that start their own mpiexec job or demo (their sessions run CPU
# ranks) or fork JAX ranks themselves: not run again
NOT_FUNCTIONAL = ("across_hosts", "on_jax_ranks", "demo_resumes")

JAX_SKIPS = {
    "test_ops.py::TestOps::test_failure_after_the_collective_applies_nothing":
        "its last rank fails through an Assert op, which PyTensor's JAX backend drops",
    "test_ops.py::TestOps::test_python_backend":
        "a JAX session compiles with mode='JAX' only (FAST_COMPILE is refused when the function is made)",
    "test_exchange.py::test_ps_failing_worker":
        "its worker fails through an Assert op, which PyTensor's JAX backend drops (JAX tracing removes "
        "assertions), so nothing raises there",
    "test_batching.py::test_batch_s_selecting_nothing":
        "PyTensor's JAX backend cannot take max() of an empty array (plain PyTensor JAX raises the same "
        "ValueError, numba returns -inf), so the all-empty call fails after the workers ran",
}


def _jax_mode():
    return os.environ.get("SYNK_MODE", "").strip().upper() == "JAX"


def pytest_configure(config):
    config.addinivalue_line("markers", "functional: the functional suite, run again with SYNK_MODE=JAX "
                                       "(scripts/test.sh)")


def pytest_collection_modifyitems(config, items):
    jax = _jax_mode()
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if getattr(item, "module", None) else ""
        if module in FUNCTIONAL_MODULES and not any(w in item.name for w in NOT_FUNCTIONAL):
            item.add_marker(pytest.mark.functional)
        if jax:
            key = item.nodeid.split("/")[-1].split("[")[0]
            reason = JAX_SKIPS.get(key)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=f"under SYNK_MODE=JAX: {reason}"))
