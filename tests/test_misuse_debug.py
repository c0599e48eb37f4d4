"""Debug mode: ``synk.fork(debug=True)`` or ``SYNK_DEBUG=1`` fingerprints every command on
every rank (``synk.debug_log()``) and names the first rank that disagrees
(``synk.DebugMismatch``); off by default; a mismatch still drains the failed command.  And
update modes, checked in the master when the function is made."""
import os
import resource
import types

import numpy as np
import pytest
import pytensor
import pytensor.tensor as T

import synkhronos as synk
import synk_testutil as tu

pytestmark = pytest.mark.filterwarnings("ignore:Numba will use object mode")

N = 3


# ==============================================================================================
# Debug mode

def _debug_session(debug_arg, monkeypatch):
    if debug_arg is None:
        monkeypatch.setenv("SYNK_DEBUG", "1")
    else:
        monkeypatch.delenv("SYNK_DEBUG", raising=False)
    synk.fork(N, debug=debug_arg)
    x = T.vector("x", dtype="float64")
    w = pytensor.shared(np.zeros(4), name="w")
    v2 = pytensor.shared(np.zeros(4), name="v2")
    f = synk.function([x], [(T.sum(x), "sum"), (T.sum(w) + T.sum(v2), None)])
    synk.distribute()
    return types.SimpleNamespace(f=f, w=w, v2=v2)


@pytest.mark.parametrize("debug_arg", [True, None], ids=["fork-debug", "SYNK_DEBUG"])
def test_debug_fingerprints_and_mismatch(debug_arg, monkeypatch, assert_clean):
    try:
        s = _debug_session(debug_arg, monkeypatch)
        assert tu.info().debug
        assert s.f(np.arange(6.0))[0] == 15.0
        synk.all_reduce(s.w)
        synk.gather(s.w)
        log = synk.debug_log()
        # one entry per command (distribute, call, all_reduce, publish), from every rank
        assert len(log) == 4
        for entry in log:
            assert sorted(entry) == [0, 1, 2]
            assert entry[0] == entry[1] == entry[2]
        assert [e[0][1] for e in log] == ["distribute", "call", "coll", "coll"]
        assert log[2][0][2] == "all_reduce" and log[2][0][3] == (("float64", (4,)),)
        seqs = [e[0][0] for e in log]
        assert seqs == sorted(seqs) and len(set(seqs)) == 4

        # a shape that differs in rank 1, then a reduction: named at once
        synk.set_value(1, s.w, np.zeros(5))
        with pytest.raises(synk.DebugMismatch) as ei:
            synk.all_reduce(s.w, op="sum")
        msg = str(ei.value)
        assert "rank 1 has (('float64', (5,)),)" in msg and "all_reduce" in msg
        assert "rank 0 (master) has (('float64', (4,)),)" in msg
        assert isinstance(ei.value, synk.SynkError)
        assert synk.debug_log()[-1][1][3] == (("float64", (5,)),)
        for r in range(N):                              # nothing changed
            assert synk.get_value(r, s.w).shape == ((5,) if r == 1 else (4,))
        synk.set_value(1, s.w, np.ones(4))
        synk.all_reduce(s.w, op="sum")
        np.testing.assert_array_equal(synk.gather(s.w), np.ones((N, 4)))
        synk.close()
    finally:
        synk.close()
    assert_clean()


def test_update_modes_are_checked_in_the_master(assert_clean):
    """'share' (a gradient's update mode: it scales) takes a float variable only;
    'gather' is no update mode; a misspelt mode names the ones there are."""
    try:
        synk.fork(1)
        iv = pytensor.shared(np.zeros(3, dtype="int64"), name="iv")
        fv = pytensor.shared(np.zeros(3), name="fv")
        x = T.matrix("x", dtype="float64")
        with pytest.raises(TypeError, match="float variable"):
            synk.function([x], updates=[(iv, T.cast(T.sum(x, axis=0), "int64"), "share")])
        with pytest.raises(ValueError, match="cannot use reduce mode 'gather'"):
            synk.function([x], updates=[(fv, T.sum(x, axis=0), "gather")])
        with pytest.raises(ValueError, match="'share'"):
            synk.function([x], updates=[(fv, T.sum(x, axis=0), "shares")])
        y = T.vector("y", dtype="float64")       # an input listed as scattered and as broadcast
        with pytest.raises(ValueError, match="y is in both inputs and bcast_inputs"):
            synk.function([x, y], (T.sum(x) + T.sum(y), "sum"), bcast_inputs=[y])
    finally:
        synk.close()
    assert_clean()


def test_debug_off_by_default(monkeypatch, assert_clean):
    monkeypatch.delenv("SYNK_DEBUG", raising=False)
    try:
        synk.fork(2)
        assert not tu.info().debug
        synk.close()
        monkeypatch.setenv("SYNK_DEBUG", "0")
        synk.fork(2)
        assert not tu.info().debug and synk.debug_log() == []
    finally:
        synk.close()
    assert_clean()


def test_debug_mismatch_still_drains(monkeypatch, assert_clean):
    try:
        s = _debug_session(True, monkeypatch)
        synk.set_value(1, s.v2, np.zeros(5))            # rank 1: a different shape
        pid = tu.pid_of(2)                              # rank 2: cannot make its slot
        old = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        fds = {int(x) for x in os.listdir(f"/proc/{pid}/fd")}
        low = next(i for i in range(10 ** 6) if i not in fds)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (low, old[1]))
        try:
            with pytest.raises(synk.DebugMismatch) as ei:
                synk.all_reduce(s.v2)
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, old)
        try:
            assert isinstance(ei.value.__cause__, synk.WorkerError)
            # nothing left over from the failed command confuses the next ones
            for r in range(3):
                synk.set_value(r, s.v2, np.full(4, float(r)))
            synk.all_reduce(s.v2, op="sum")
            assert all(np.array_equal(synk.get_value(r, s.v2), np.full(4, 3.0)) for r in range(3))
            assert s.f(np.arange(6.0))[0] == 15.0
        finally:
            synk.close()
    finally:
        synk.close()
    assert_clean()
