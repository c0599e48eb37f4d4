"""Misuse: whatever the user does, a clear error or a documented behaviour, never a hang,
a crash or wrong data.

Documented behaviours checked here:

* calls from several threads at once are serialized (one command at a time, a lock in the
  runtime): every thread gets its own correct results;
* reductions (all_reduce, reduce) of a variable whose shape differs between ranks raise
  ValueError in the master (listing every rank's shape, from the workers' WorkerError) and
  leave every rank's value as it was; gather returns such values exactly, as a list;
* empty values and empty batches work (empty results, as serial numpy / PyTensor);
* NaN and Inf pass through calls and collectives as numpy would compute them;
* a function that cannot be pickled fails ``distribute()`` with a TypeError that says so
  (the session stays open, undistributed); an Op the workers cannot import fails it with a
  WorkerError naming every worker;
* ``synk.fork()`` inside a worker raises RuntimeError there (a WorkerError in the master);
* after close() (or after a worker died) every entry point raises RuntimeError;
* debug mode (``synk.fork(debug=True)`` or ``SYNK_DEBUG=1``) fingerprints every command on
  every rank (``synk.debug_log()``) and names the first rank that disagrees
  (``synk.DebugMismatch``).

Covered elsewhere and not repeated: fork twice and calls after close for functions and Data
(test_failures), unequal trailing shapes in gather/all_gather (test_collectives)."""
import importlib.util
import os
import resource
import sys
import threading
import types

import numpy as np
import pytest
import pytensor
import pytensor.tensor as T
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

import synkhronos as synk
import synk_testutil as tu
import _fault_ops as fo

fo.quiet()
pytestmark = pytest.mark.filterwarnings("ignore:Numba will use object mode")

N = 3


def modes_ref(X, Y):
    """Serial results of f (numpy, float64) on the whole batch."""
    return [float(np.sum(X @ Y)), float(np.max(X)), float(np.min(X)), float(np.mean(X)),
            float(np.prod(X)), X.sum(axis=1)]


@pytest.fixture(scope="class")
def S():
    synk.fork(N)
    try:
        x = T.matrix("x", dtype="float64")
        y = T.vector("y", dtype="float64")
        w = pytensor.shared(np.zeros(4), name="w")
        u = pytensor.shared(np.zeros((2, 3)), name="u")
        f = synk.function([x], [(T.sum(x.dot(y)), "sum"), (T.max(x), "max"), (T.min(x), "min"),
                                (T.mean(x), "avg"), (T.prod(x), "prod"), (x.sum(axis=1), "gather")],
                          bcast_inputs=[y])
        v = T.vector("v", dtype="float64")
        ff = synk.function([v], [(T.sum(fo.Fault("fork", 1)(v)), "sum"), (T.sum(w) + T.sum(u), None)])
        synk.distribute()
        yield types.SimpleNamespace(f=f, ff=ff, w=w, u=u)
    finally:
        synk.close()


def close_nan(a, b, rtol=1e-9):
    np.testing.assert_allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float), rtol=rtol,
                               atol=1e-12, equal_nan=True)


class TestInSession:

    # ---- threads ----------------------------------------------------------------------------

    def test_two_threads_call_at_once(self, S):
        """Two threads call the same function (and collectives) concurrently: the runtime's
        lock serializes them and each gets its own correct results."""
        rng = np.random.default_rng(0)
        inputs = [(rng.standard_normal((7 + t, 4)), rng.standard_normal(4)) for t in range(2)]
        refs = [modes_ref(*xy) for xy in inputs]
        start = threading.Barrier(2)
        errors = []
        counts = [0, 0]

        def worker(t):
            try:
                X, Y = inputs[t]
                d = synk.data(X)                # a Data per thread, and plain arrays
                start.wait()
                for i in range(100):
                    res = S.f(d if i % 2 else X, Y, num_slices=1 + i % 3)
                    for a, b in zip(res, refs[t]):
                        close_nan(a, b, 1e-9)
                    if t == 1 and i % 10 == 0:  # collectives interleaved from this thread
                        val = np.full(4, float(i))
                        synk.broadcast(S.w, val)
                        np.testing.assert_array_equal(synk.gather(S.w), np.stack([val] * N))
                    counts[t] += 1
            except BaseException as e:      # pragma: no cover - reported below
                errors.append((t, repr(e)))
                start.abort()

        old = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)         # switch threads often
        try:
            ths = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
            for th in ths:
                th.start()
            for th in ths:
                th.join(120)
            assert not any(th.is_alive() for th in ths), "a thread hung"
        finally:
            sys.setswitchinterval(old)
        assert errors == []
        assert counts == [100, 100]

    # ---- shapes differing between ranks ------------------------------------------------------

    def test_reduction_of_different_lengths(self, S):
        vals = [np.full(4, 1.0), np.full(6, 2.0), np.full(4, 3.0)]   # rank 1 differs in length
        for r in range(N):
            synk.set_value(r, S.w, vals[r])
        for run in (lambda: synk.all_reduce(S.w), lambda: synk.reduce(S.w),
                    lambda: synk.reduce(S.w, in_place=False)):
            with pytest.raises(ValueError, match=r"\[\(4,\), \(6,\), \(4,\)\] \(by rank\)") as ei:
                run()
            assert isinstance(ei.value.__cause__, synk.WorkerError)
            for r in range(N):
                np.testing.assert_array_equal(synk.get_value(r, S.w), vals[r])
        g = synk.gather(S.w)                  # exact, per rank
        assert isinstance(g, list) and [len(p) for p in g] == [4, 6, 4]
        synk.all_gather(S.w)                  # concatenation is fine with different lengths
        np.testing.assert_array_equal(synk.get_value(2, S.w), np.concatenate(vals))
        synk.broadcast(S.w, np.zeros(4))

    # ---- huge and empty inputs ---------------------------------------------------------------

    def test_large_inputs(self, S):
        """Tens of MB through a call and through collectives: correct, nothing left over."""
        X = np.ones((400_000, 4)) * 0.5          # 12.8 MB
        Y = np.arange(4.0)
        res = S.f(X, Y)
        assert res[0] == pytest.approx(400_000 * 3.0) and res[1] == 0.5 and len(res[5]) == 400_000
        big = np.arange(2_000_000, dtype=np.float64)     # 16 MB
        synk.broadcast(S.w, big)
        synk.all_reduce(S.w, op="max")
        np.testing.assert_array_equal(synk.get_value(2, S.w), big)
        synk.broadcast(S.w, np.zeros(4))

    def test_empty_values_in_collectives(self, S):
        e = np.zeros(0)
        synk.broadcast(S.w, e)
        assert synk.get_shapes(S.w) == [(0,)] * N
        synk.all_reduce(S.w, op="sum")
        synk.reduce(S.w, op="max")
        assert synk.reduce(S.w, op="prod", in_place=False).shape == (0,)
        assert synk.gather(S.w).shape == (N, 0)
        assert synk.gather(S.w, nd_up=0).shape == (0,)
        synk.all_gather(S.w)
        assert synk.get_lengths(S.w) == [0] * N
        synk.scatter(S.w, e)
        synk.set_value(1, S.w, e)
        assert synk.get_value(1, S.w).shape == (0,)
        synk.scatter(S.u, np.zeros((0, 3)))
        assert synk.get_shapes(S.u) == [(0, 3)] * N
        synk.broadcast(S.u, np.zeros((2, 3)))
        synk.broadcast(S.w, np.zeros(4))

    def test_empty_batch_in_calls(self, S):
        Y = np.ones(4)
        X = np.ones((5, 4))
        res = S.f(X, Y, batch=[])                # no rows selected
        assert res[0] == 0.0 and len(res[5]) == 0 and res[4] == 1.0
        res = S.f(X, Y, batch=slice(2, 2))
        assert res[0] == 0.0 and len(res[5]) == 0

    # ---- NaN and Inf ------------------------------------------------------------------------

    @pytest.mark.parametrize("special", ["nan", "inf", "-inf", "mixed"])
    def test_nan_inf_through_calls(self, S, special):
        X = np.arange(36.0).reshape(9, 4) / 10 + 1
        if special == "mixed":
            X[1, 2], X[4, 0], X[8, 3] = np.nan, np.inf, -np.inf
        else:
            X[4, 1] = float(special)              # in rank 1's shard only
        Y = np.array([1.0, -1.0, 0.5, 2.0])
        with np.errstate(all="ignore"):
            ref = modes_ref(X, Y)
            for num_slices in (1, 2):
                res = S.f(X, Y, num_slices=num_slices)
                for a, b in zip(res, ref):
                    close_nan(a, b)
        Yn = np.array([np.nan, 0, 0, 0])          # NaN in a broadcast input
        with np.errstate(all="ignore"):
            assert np.isnan(S.f(X, Yn)[0])

    @pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "prod"])
    def test_nan_inf_through_collectives(self, S, op):
        vals = [np.array([1.0, np.nan, 2.0, np.inf]), np.array([np.inf, 3.0, -np.inf, 1.0]),
                np.array([0.5, 1.0, np.nan, -np.inf])]
        fn = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min, "prod": np.prod}[op]
        with np.errstate(all="ignore"):
            want = fn(np.stack(vals), axis=0)
            for r in range(N):
                synk.set_value(r, S.w, vals[r])
            close_nan(synk.reduce(S.w, op=op, in_place=False), want)
            synk.all_reduce(S.w, op=op)
        for r in range(N):
            close_nan(synk.get_value(r, S.w), want)
        synk.broadcast(S.w, np.zeros(4))

    # ---- fork inside a worker ----------------------------------------------------------------

    def test_fork_inside_a_worker(self, S):
        v = fo.with_trigger(np.ones(9), 1, N)
        with pytest.raises(synk.WorkerError) as ei:
            S.ff(v)
        assert ei.value.ranks == [1]
        assert "cannot be called inside a synkhronos worker" in ei.value.errors[1]
        assert S.ff(np.ones(9))[0] == 9.0     # still fine

    # ---- Data too large -------------------------------------------------------------------

    def test_data_larger_than_shared_memory_is_refused(self, S):
        free = os.statvfs("/dev/shm")
        size = free.f_frsize * free.f_blocks * 64          # far beyond the tmpfs
        d = None
        try:
            with pytest.raises(MemoryError):
                d = synk.data(shape=(size // 8,), dtype="float64")
        finally:
            if d is not None:
                d.free_memory()                 # never touch it: that could SIGBUS

    def test_data_size_overflow_is_refused_cleanly(self, S):
        before = set(tu.shm_entries(tu.prefix()))
        with pytest.raises(MemoryError):
            synk.data(shape=(2 ** 61,), dtype="float64")
        assert set(tu.shm_entries(tu.prefix())) - before == set()

    def test_data_huge_shape_raises_in_master(self, S):
        """Whatever the error type, an impossible size raises at once in the master and the
        session keeps working."""
        for shape in [(2 ** 61,), (2 ** 60,), (10 ** 12, 10 ** 12)]:
            with pytest.raises((ValueError, MemoryError, OSError)):
                synk.data(shape=shape, dtype="float64")
        res = S.f(np.ones((3, 4)), np.ones(4))
        assert res[0] == 12.0


# ==============================================================================================
# Distribute: functions that cannot be pickled, or unpickled by the workers

def test_unpicklable_function_at_distribute(assert_clean):
    class LocalOp(Op):                       # a local class: pickle cannot name it
        __props__ = ()

        def make_node(self, x):
            return Apply(self, [x], [x.type()])

        def perform(self, node, inputs, out):
            out[0][0] = np.array(inputs[0], copy=True)

    try:
        synk.fork(2)
        v = T.vector("v", dtype="float64")
        f = synk.function([v], (T.sum(LocalOp()(v)), "sum"))
        seq = tu.commands_sent()
        with pytest.raises(TypeError, match="could not pickle") as ei:
            synk.distribute()
        assert "importable" in str(ei.value)
        assert tu.commands_sent() == seq, "nothing must reach the workers"
        assert tu.is_open() and not tu.info().distributed   # documented: still open
        with pytest.raises(RuntimeError, match="distribute"):
            f(np.ones(3))
        synk.close()
        assert synk.fork(2) == 2                 # and a new session works
        v = T.vector("v", dtype="float64")
        g = synk.function([v], (T.sum(v), "sum"))
        synk.distribute()
        assert g(np.arange(4.0)) == 6.0
    finally:
        synk.close()
    assert_clean()


_HIDDEN_OP = '''
import numpy as np
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

class HiddenOp(Op):
    __props__ = ()

    def make_node(self, x):
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, out):
        out[0][0] = np.array(inputs[0], copy=True)
'''


def test_op_the_workers_cannot_import(tmp_path, assert_clean):
    """An Op from a module the master loaded from a path the workers do not have: every
    worker fails to unpickle it, and distribute() names them all."""
    path = tmp_path / "synk_hidden_op_mod.py"
    path.write_text(_HIDDEN_OP)
    spec = importlib.util.spec_from_file_location("synk_hidden_op_mod", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["synk_hidden_op_mod"] = mod
    spec.loader.exec_module(mod)
    try:
        synk.fork(N)
        v = T.vector("v", dtype="float64")
        synk.function([v], (T.sum(mod.HiddenOp()(v)), "sum"))
        with pytest.raises(synk.WorkerError) as ei:
            synk.distribute()
        assert ei.value.ranks == [1, 2]
        assert all("synk_hidden_op_mod" in ei.value.errors[r] for r in (1, 2))
        assert "ModuleNotFoundError" in ei.value.errors[1]
        assert tu.is_open()
        synk.close()
    finally:
        sys.modules.pop("synk_hidden_op_mod", None)
        synk.close()
    assert_clean()


# ==============================================================================================
# Everything after close, and after a worker died

def _every_entry_point(f, var, d):
    return {
        "call": lambda: f(np.ones(3)),
        "function": lambda: synk.function([T.vector("q")], T.sum(T.vector("q"))),
        "distribute": synk.distribute,
        "data": lambda: synk.data(np.ones(3)),
        "Data.set_value": lambda: d.set_value(np.ones(5)),
        "Data.set_shape": lambda: d.set_shape((7,)),
        "Data.free_memory": d.free_memory,
        "broadcast": lambda: synk.broadcast(var),
        "scatter": lambda: synk.scatter(var, np.ones(6)),
        "gather": lambda: synk.gather(var),
        "all_gather": lambda: synk.all_gather(var),
        "reduce": lambda: synk.reduce(var),
        "all_reduce": lambda: synk.all_reduce(var),
        "set_value": lambda: synk.set_value(1, var, np.ones(3)),
        "get_value": lambda: synk.get_value(1, var),
        "get_shapes": lambda: synk.get_shapes(var),
        "get_lengths": lambda: synk.get_lengths(var),
    }


@pytest.mark.parametrize("how", ["close", "worker died"])
def test_everything_after_close(how, assert_clean):
    try:
        synk.fork(2)
        v = T.vector("v", dtype="float64")
        w = pytensor.shared(np.zeros(3), name="w")
        f = synk.function([v], [(T.sum(v), "sum"), (T.sum(w), None)])
        synk.distribute()
        d = synk.data(np.ones(3))
        assert f(d)[0] == 3.0
        if how == "close":
            synk.close()
        else:
            tu.kill_rank(1)
            with pytest.raises(synk.WorkerDied):
                synk.all_reduce(w)
        for name, fn in _every_entry_point(f, w, d).items():
            with pytest.raises(RuntimeError, match="fork|closed") as ei:
                fn()
            assert not isinstance(ei.value, (synk.WorkerError, synk.WorkerDied)), name
        assert synk.debug_log() == []
        synk.close()                              # harmless
    finally:
        synk.close()
    assert_clean()


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
