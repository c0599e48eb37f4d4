"""Misuse inside one session: whatever the user does, a clear error or a documented
behaviour, never a hang, a crash or wrong data.

Documented behaviours checked here:

* calls from several threads at once are serialized (one command at a time, a lock in the
  runtime): every thread gets its own correct results;
* reductions (all_reduce, reduce) of a variable whose shape differs between ranks raise
  ValueError in the master (listing every rank's shape, from the workers' WorkerError) and
  leave every rank's value as it was; gather returns such values exactly, as a list;
* empty values and empty batches work (empty results, as serial numpy / PyTensor);
* NaN and Inf pass through calls and collectives as numpy would compute them;
* ``synk.fork()`` inside a worker raises RuntimeError there (a WorkerError in the master);
* a Data larger than shared memory, or of an impossible size, is refused in the master.

Other misuse: functions the workers cannot get and every entry point after close
(test_misuse_lifecycle), debug mode and update modes (test_misuse_debug), a signal handler
calling back in and a forked child (test_misuse_process).

Covered elsewhere and not repeated: unequal trailing shapes in gather/all_gather
(test_collectives)."""
import os
import sys
import threading
import types

import numpy as np
import pytest
import pytensor
import pytensor.tensor as T

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
