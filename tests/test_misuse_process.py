"""Misuse across processes and signals: a signal handler that calls synkhronos while a call
is in flight (the nested call is refused, NestedCall), and a child forked by user code,
which never touches the parent's session (using synkhronos there raises ForeignSession)."""
import os

import numpy as np
import pytest
import pytensor.tensor as T

import synkhronos as synk
import synk_testutil as tu
import _fault_ops as fo

fo.quiet()
pytestmark = pytest.mark.filterwarnings("ignore:Numba will use object mode")


# ==============================================================================================
# Re-entrant use (a signal handler that calls synkhronos) and processes forked by user code

def _slow_session():
    import _fault_ops as fo
    fo.quiet()
    synk.fork(2)
    x = T.vector("x", dtype="float64")
    slow = synk.function([x], (T.sum(fo.Fault("sleep")(x)), "sum"))
    fast = synk.function([x], (T.sum(x), "sum"))
    synk.distribute()
    assert slow(np.arange(4.0)) == 6.0 and fast(np.arange(4.0)) == 6.0
    return slow, fast, fo.with_trigger(np.ones(4), 1, 2)


@pytest.mark.parametrize("handler_catches", [True, False])
def test_call_from_a_signal_handler_during_a_call(handler_catches, assert_clean):
    """A SIGALRM handler calls synkhronos while a call is in flight on the same thread: the
    nested call is refused at once (NestedCall); the outer call either completes correctly
    (the handler caught the error) or is interrupted by it; never a wrong result."""
    import signal as sig
    seen = []

    def handler(signum, frame):
        try:
            seen.append(fast(np.arange(3.0)))
        except synk.SynkError as e:
            seen.append(e)
            if not handler_catches:
                raise
    old = sig.signal(sig.SIGALRM, handler)
    try:
        slow, fast, data = _slow_session()
        sig.setitimer(sig.ITIMER_REAL, 0.3)
        if handler_catches:
            assert slow(data) == 3.0 + _trigger()         # the outer call is unharmed
        else:
            with pytest.raises(synk.SynkError, match="another synkhronos call is in progress"):
                slow(data)
        assert len(seen) == 1 and isinstance(seen[0], synk.SynkError), seen
        assert "signal handler" in str(seen[0])
        assert fast(np.arange(5.0)) == 10.0 and slow(np.arange(4.0)) == 6.0   # all good after
    finally:
        sig.setitimer(sig.ITIMER_REAL, 0)
        sig.signal(sig.SIGALRM, old)
        synk.close()
    assert_clean()


def _trigger():
    import _fault_ops as fo
    return fo.TRIGGER


@pytest.mark.parametrize("how", ["os.fork", "multiprocessing"])
def test_forked_child_never_touches_the_session(how, assert_clean):
    """A child forked by user code that exits normally runs the parent's atexit and weakref
    finalizers: the parent's session, its workers and its shared memory must survive, and
    using synkhronos in the child raises a clear error."""
    import multiprocessing as mp
    try:
        synk.fork(2)
        x = T.vector("x", dtype="float64")
        f = synk.function([x], (T.sum(x), "sum"))
        synk.distribute()
        d = synk.data(np.arange(6.0))
        d2 = synk.data(np.arange(3.0))            # the child drops it: its finalizer runs there
        assert f(d) == 15.0 and f(d2) == 3.0
        pids, prefix = tu.worker_pids(), tu.prefix()
        before = set(tu.shm_entries(prefix))
        if how == "os.fork":
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:                          # the child: use synkhronos, then exit normally
                os.close(r)
                try:
                    f(d)
                    msg = b"no error"
                except synk.ForeignSession as e:
                    msg = str(e).encode()
                except BaseException as e:        # noqa: BLE001
                    msg = f"wrong error {e!r}".encode()
                os.write(w, msg[:1000])
                os.close(w)
                del d2                            # a Data dropped in the child
                import atexit
                import gc
                gc.collect()
                atexit._run_exitfuncs()           # what a normal exit runs (synk.close included)
                os._exit(0)                       # (not sys.exit: pytest would catch it here)
            os.close(w)
            msg = os.read(r, 1000).decode()
            os.close(r)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0
        else:
            ctx = mp.get_context("fork")
            q = ctx.Queue()
            p = ctx.Process(target=_child_uses_synk, args=(f, d, q))
            p.start()
            msg = q.get(timeout=30)
            p.join(30)
            assert p.exitcode == 0
        assert "belongs to process" in msg and "forked" in msg, msg
        assert all(tu.pid_running(p) for p in pids.values())
        assert set(tu.shm_entries(prefix)) >= before          # nothing of the parent's removed
        assert f(d) == 15.0 and f(d2) == 3.0 and f(np.arange(4.0)) == 6.0
    finally:
        synk.close()
    assert_clean()


def _child_uses_synk(f, d, q):
    try:
        f(d)
        q.put("no error")
    except synk.ForeignSession as e:
        q.put(str(e))
    except BaseException as e:            # noqa: BLE001
        q.put(f"wrong error {e!r}")
