"""Collectives on shared variables, checked against numpy on every rank.

One fork per rank count (n = 1, 2, 3: a class-scoped, parametrized fixture); in each session
every op x dtype x ndim, unequal shapes, Data and numpy values, interleavings with function
calls whose updates replace the variables' storage, argument errors (raised before any
worker is involved), and, last, a worker killed during collectives.

Each rank gets a distinct known value with ``set_value(rank, ...)``; results are read back
with ``gather`` / ``get_value`` and compared with numpy applied to the stacked per-rank
values (same dtype rules: integer sums wrap in their dtype, integer ``avg`` is the float64
mean rounded half to even).
"""
import time
import types

import numpy as np
import pytest
import pytensor
import pytensor.tensor as T

import synkhronos as synk
import synk_testutil as tu
from synkhronos.errors import WorkerError
from synkhronos.shards import split

DTYPES = ["float16", "float32", "float64", "int8", "int16", "int32", "int64",
          "uint8", "uint16", "uint32", "uint64", "bool"]
SHAPES = {0: (), 1: (5,), 2: (3, 4), 3: (2, 3, 2)}
OPS = ["avg", "sum", "prod", "max", "min"]
BIG = 300_007          # elements: several reduction blocks per rank, odd chunk edges
TOL = {"float16": 2e-2, "float32": 1e-5, "float64": 1e-12}


# ---- expected values ------------------------------------------------------------------------

def expected(op, parts, dtype):
    """numpy's reduction of the per-rank values with synkhronos' dtype rules."""
    dt = np.dtype(dtype)
    stack = np.stack([np.asarray(p, dt) for p in parts])
    if op == "avg":
        mean = stack.astype(np.float64).mean(axis=0)
        return (np.rint(mean) if dt.kind in "biu" else mean).astype(dt)
    if op == "sum":
        if dt.kind == "f":
            return stack.astype(np.float64).sum(axis=0).astype(dt)
        return np.add.reduce(stack, axis=0, dtype=dt)       # wraps in the dtype
    if op == "prod":
        if dt.kind == "f":
            return stack.astype(np.float64).prod(axis=0).astype(dt)
        return np.multiply.reduce(stack, axis=0, dtype=dt)
    return stack.max(axis=0) if op == "max" else stack.min(axis=0)


def check(actual, want, dtype, what=""):
    dt = np.dtype(dtype)
    actual = np.asarray(actual)
    assert actual.dtype == dt, f"{what}: dtype {actual.dtype} != {dt}"
    assert actual.shape == np.shape(want), f"{what}: shape {actual.shape} != {np.shape(want)}"
    if dt.kind == "f":
        np.testing.assert_allclose(actual.astype(np.float64), np.asarray(want, np.float64),
                                   rtol=TOL[dt.name], atol=TOL[dt.name], err_msg=what)
    else:
        np.testing.assert_array_equal(actual, want, err_msg=what)


def close(actual, want, what=""):
    np.testing.assert_allclose(actual, want, rtol=1e-9, atol=1e-9, err_msg=what)


def values_for(op, dtype, shape, n, rng):
    """Distinct per-rank values of ``dtype`` that make ``op`` well defined (no overflow
    where numpy would not wrap either; small factors for prod)."""
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return [rng.integers(0, 2, shape).astype(bool) for _ in range(n)]
    if dt.kind in "iu":
        info = np.iinfo(dt)
        if op == "prod":
            lo, hi = (-2, 3) if dt.kind == "i" else (0, 4)
        else:
            lo, hi = max(int(info.min), -2 ** 40), min(int(info.max), 2 ** 40)
        return [rng.integers(lo, hi, shape, endpoint=True).astype(dt) for _ in range(n)]
    if op == "prod":
        return [rng.uniform(0.5, 2.0, shape).astype(dt) for _ in range(n)]
    return [(rng.standard_normal(shape) * 4).astype(dt) for _ in range(n)]


# ---- one session per rank count -----------------------------------------------------------

@pytest.fixture(scope="class", params=[1, 2, 3], ids=["n1", "n2", "n3"])
def S(request):
    n = request.param
    tu.fork(n)
    try:
        vs = {(dt, nd): pytensor.shared(np.zeros(SHAPES[nd], dt), name=f"v_{dt}_{nd}")
              for dt in DTYPES for nd in SHAPES}
        big = {dt: pytensor.shared(np.zeros(BIG, dt), name=f"big_{dt}")
               for dt in ("float16", "float64", "int32")}
        u = pytensor.shared(np.zeros((2, 3), "float64"), name="u")      # unequal shapes
        w = pytensor.shared(np.zeros(4, "float64"), name="w")            # function updates
        x = T.matrix("x", dtype="float64")
        plain = list(vs.values()) + list(big.values())
        # registers the variables; never called (no JIT)
        synk.function([], outputs=[T.sum(v) for v in plain])
        f = synk.function([x], outputs=(T.sum(u), "sum"), updates=[(w, w + T.sum(x, axis=0))])
        synk.distribute()
        unknown = pytensor.shared(np.zeros(3, "float32"), name="not_in_any_function")
        yield types.SimpleNamespace(n=n, vs=vs, big=big, u=u, w=w, f=f, unknown=unknown,
                                    rng=np.random.default_rng(1234 + n))
    finally:
        synk.close()


def set_all(S, var, parts):
    for r, p in enumerate(parts):
        synk.set_value(r, var, p)


def per_rank(S, var):
    """Every rank's value (gather with nd_up=1 returns the stack or, for unequal shapes, a list)."""
    g = synk.gather(var, nd_up=1)
    return [np.asarray(p) for p in g] if isinstance(g, list) else [g[r] for r in range(S.n)]


class TestCollectives:

    # ---- every op x dtype x ndim ----------------------------------------------------------

    @pytest.mark.parametrize("op", OPS)
    def test_all_reduce_every_dtype_and_ndim(self, S, op):
        for (dt, nd), v in S.vs.items():
            parts = values_for(op, dt, SHAPES[nd], S.n, S.rng)
            set_all(S, v, parts)
            synk.all_reduce(v, op=op)
            want = expected(op, parts, dt)
            for r, got in enumerate(per_rank(S, v)):
                check(got, want, dt, f"all_reduce {op} {dt} ndim {nd} rank {r}")
            check(v.get_value(), want, dt, f"all_reduce {op} {dt} ndim {nd} master get_value")

    @pytest.mark.parametrize("op", OPS)
    def test_reduce_every_dtype_and_ndim(self, S, op):
        for (dt, nd), v in S.vs.items():
            parts = values_for(op, dt, SHAPES[nd], S.n, S.rng)
            set_all(S, v, parts)
            want = expected(op, parts, dt)
            res = synk.reduce(v, op=op, in_place=False)
            check(res, want, dt, f"reduce(in_place=False) {op} {dt} ndim {nd}")
            for r, got in enumerate(per_rank(S, v)):          # nobody changed
                check(got, parts[r], dt, f"reduce(in_place=False) {op} {dt} ndim {nd} rank {r}")
            assert synk.reduce(v, op=op) is None
            got = per_rank(S, v)
            check(got[0], want, dt, f"reduce {op} {dt} ndim {nd} master")
            for r in range(1, S.n):                              # workers keep theirs
                check(got[r], parts[r], dt, f"reduce {op} {dt} ndim {nd} rank {r}")

    @pytest.mark.parametrize("dt", ["float16", "float64", "int32"])
    def test_large_values_many_blocks(self, S, dt):
        v = S.big[dt]
        for op in OPS:
            parts = values_for(op, dt, (BIG,), S.n, S.rng)
            set_all(S, v, parts)
            want = expected(op, parts, dt)
            res = synk.reduce(v, op=op, in_place=False)
            check(res, want, dt, f"big reduce {op} {dt}")
            synk.all_reduce(v, op=op)
            for r in range(S.n):
                check(synk.get_value(r, v), want, dt, f"big all_reduce {op} {dt} rank {r}")

    def test_several_variables_in_one_call(self, S):
        keys = [("float32", 2), ("int16", 1), ("uint8", 0)]
        vars_ = [S.vs[k] for k in keys]
        parts = [values_for("max", dt, SHAPES[nd], S.n, S.rng) for dt, nd in keys]
        for v, p in zip(vars_, parts):
            set_all(S, v, p)
        res = synk.reduce(vars_, op="max", in_place=False)
        assert isinstance(res, tuple) and len(res) == 3
        for (dt, _), r_, p in zip(keys, res, parts):
            check(r_, expected("max", p, dt), dt)
        one = synk.reduce([vars_[0]], op="max", in_place=False)   # a list gives a tuple
        assert isinstance(one, tuple) and len(one) == 1
        synk.all_reduce(tuple(vars_), op="max")
        got = synk.gather(vars_)
        assert isinstance(got, tuple) and len(got) == 3
        for (dt, _), g, p in zip(keys, got, parts):
            for r in range(S.n):
                check(g[r], expected("max", p, dt), dt)
        vals = synk.get_value(S.n - 1, vars_)
        assert isinstance(vals, tuple) and len(vals) == 3
        shapes = synk.get_shapes(vars_)
        assert shapes == tuple([SHAPES[nd]] * S.n for _, nd in keys)

    # ---- broadcast, set_value / get_value, gather ------------------------------------------

    def test_broadcast(self, S):
        v = S.vs[("float32", 2)]
        parts = values_for("sum", "float32", (3, 4), S.n, S.rng)
        set_all(S, v, parts)
        synk.broadcast(v)                                   # the master's value
        for r, got in enumerate(per_rank(S, v)):
            check(got, parts[0], "float32", f"rank {r}")
        new = np.arange(10, dtype="float32").reshape(5, 2)  # numpy value, new shape
        synk.broadcast(v, new)
        for got in per_rank(S, v):
            check(got, new, "float32")
        assert synk.get_shapes(v) == [(5, 2)] * S.n
        d = synk.data(np.full((3, 4), 7, "float32"))       # Data value
        synk.broadcast([v], [d])
        for got in per_rank(S, v):
            check(got, d.data, "float32")
        big = S.big["float64"]                              # large: the split path
        val = S.rng.standard_normal(BIG)
        synk.broadcast(big, val)
        for r in range(S.n):
            check(synk.get_value(r, big), val, "float64")
        b = S.vs[("bool", 0)]
        synk.broadcast(b, True)
        check(synk.gather(b), np.ones(S.n, bool), "bool")

    def test_set_value_get_value_every_rank(self, S):
        for (dt, nd), v in S.vs.items():
            parts = values_for("sum", dt, SHAPES[nd], S.n, S.rng)
            for r in reversed(range(S.n)):
                synk.set_value(r, v, parts[r])
            for r in range(S.n):
                got = synk.get_value(r, v)
                check(got, parts[r], dt, f"{dt} ndim {nd} rank {r}")
                got[...] = 0                              # a copy: the rank's value is intact
            check(v.get_value(), parts[0], dt)
            check(synk.gather(v, nd_up=1), np.stack(parts), dt)
            if nd:
                check(synk.gather(v, nd_up=0), np.concatenate(parts), dt)

    def test_set_value_data_and_batch(self, S):
        v = S.vs[("int64", 2)]
        src = np.arange(24, dtype="int64").reshape(8, 3)
        d = synk.data(src)
        last = S.n - 1
        synk.set_value(last, v, d)                              # Data
        check(synk.get_value(last, v), src, "int64")
        synk.set_value(last, v, src, batch=slice(2, 5))         # numpy + slice
        check(synk.get_value(last, v), src[2:5], "int64")
        synk.set_value(0, v, d, batch=[7, 0, 3])                # Data + index list, master
        check(synk.get_value(0, v), src[[7, 0, 3]], "int64")
        synk.set_value(last, v, d, batch=2)                     # Data + int
        check(synk.get_value(last, v), src[:2], "int64")
        check(v.get_value(), src[[7, 0, 3]] if last else src[:2], "int64")
        h = S.vs[("float16", 0)]
        synk.set_value(last, h, synk.data(np.float16(2.5)))       # 0-d Data
        check(synk.get_value(last, h), np.float16(2.5), "float16")
        synk.broadcast(h, synk.data(np.float16(-1.5)))
        check(synk.gather(h), np.full(S.n, -1.5, "float16"), "float16")
        synk.set_value(0, [v, S.vs[("uint8", 0)]], [src, 5])    # several, python scalar
        check(v.get_value(), src, "int64")
        check(synk.get_value(0, S.vs[("uint8", 0)]), np.uint8(5), "uint8")

    # ---- unequal shapes: scatter, gather, get_lengths, all_gather ----------------------------

    def test_scatter_unequal_lengths_then_gather(self, S):
        u = S.u
        n = S.n
        arr = np.arange(7 * 3, dtype="float64").reshape(7, 3)   # 7 rows: unequal for n = 2, 3
        b = split(7, n)
        synk.scatter(u, arr)
        lengths = [b[r + 1] - b[r] for r in range(n)]
        assert synk.get_lengths(u) == lengths
        assert synk.get_shapes(u) == [(k, 3) for k in lengths]
        assert synk.get_lengths([u]) == (lengths,)
        check(synk.gather(u, nd_up=0), arr, "float64")
        g1 = synk.gather(u, nd_up=1)
        if len(set(lengths)) == 1:
            check(g1, arr.reshape(n, -1, 3), "float64")
        else:
            assert isinstance(g1, list) and len(g1) == n
            for r in range(n):
                check(g1[r], arr[b[r]:b[r + 1]], "float64")
        for r in range(n):
            check(synk.get_value(r, u), arr[b[r]:b[r + 1]], "float64")
        # all_gather: every rank gets the concatenation, rank order
        synk.all_gather(u)
        for r in range(n):
            check(synk.get_value(r, u), arr, "float64")
        assert synk.get_lengths(u) == [7] * n

    def test_scatter_values_of_different_lengths_split_each_on_its_own(self, S):
        """As in the original (its MNIST demo scatters the training and validation sets in
        one call): every value is split over the ranks by its own length."""
        n = S.n
        train = np.arange(11 * 3, dtype="float64").reshape(11, 3)
        valid = -np.arange(4 * 3, dtype="float64").reshape(4, 3)
        x = S.vs[("float64", 2)]
        synk.scatter([S.u, x], [train, valid])
        for var, arr in ((S.u, train), (x, valid)):
            b = split(len(arr), n)
            for r in range(n):
                check(synk.get_value(r, var), arr[b[r]:b[r + 1]], "float64")
        synk.scatter([S.u, x], [synk.data(train), valid], batch=[0, 2, 3])   # batch on both
        for var, arr in ((S.u, train), (x, valid)):
            b = split(3, n)
            for r in range(n):
                check(synk.get_value(r, var), arr[[0, 2, 3]][b[r]:b[r + 1]], "float64")

    def test_scatter_batch_and_data(self, S):
        u = S.u
        n = S.n
        arr = np.arange(10 * 3, dtype="float64").reshape(10, 3)
        d = synk.data(arr)
        for batch, rows in [(None, np.arange(10)), (slice(1, 8), np.arange(1, 8)), (5, np.arange(5)),
                            ([9, 0, 4, 4, 2], np.array([9, 0, 4, 4, 2]))]:
            for value in (arr, d):
                synk.scatter(u, value, batch=batch)
                b = split(len(rows), n)
                for r in range(n):
                    check(synk.get_value(r, u), arr[rows[b[r]:b[r + 1]]], "float64",
                          f"scatter batch={batch} {type(value).__name__} rank {r}")
                check(synk.gather(u, nd_up=0), arr[rows], "float64")
        # empty share on some ranks (fewer rows than ranks)
        synk.scatter(u, arr[:1])
        assert sum(synk.get_lengths(u)) == 1
        check(synk.gather(u, nd_up=0), arr[:1], "float64")
        synk.all_gather(u)
        assert synk.get_lengths(u) == [1] * n

    def test_unequal_trailing_shapes(self, S):
        u = S.u
        for r in range(S.n):
            synk.set_value(r, u, np.full((2, r + 1), r, "float64"))
        g0 = synk.gather(u, nd_up=0)
        g1 = synk.gather(u, nd_up=1)
        for g in (g0, g1):
            if S.n == 1:
                check(np.asarray(g).reshape(2, 1), np.zeros((2, 1)), "float64")
                continue
            assert isinstance(g, list) and len(g) == S.n
            for r in range(S.n):
                check(g[r], np.full((2, r + 1), r, "float64"), "float64")
        if S.n > 1:
            with pytest.raises((ValueError, WorkerError)):
                synk.all_gather(u)
            with pytest.raises((ValueError, WorkerError)):
                synk.all_reduce(u)
            with pytest.raises((ValueError, WorkerError)):
                synk.reduce(u, in_place=False)
            for r in range(S.n):                               # nothing changed
                check(synk.get_value(r, u), np.full((2, r + 1), r, "float64"), "float64")
        synk.broadcast(u, np.ones((2, 3)))                     # and all works after
        synk.all_reduce(u, op="sum")
        check(synk.gather(u), np.full((S.n, 2, 3), S.n, "float64"), "float64")

    @pytest.mark.parametrize("large", ["rank 0", "the others"])
    def test_shapes_unequal_across_the_small_message_size(self, S, large):
        """An all-reduce goes one way for small values and another for large ones, chosen
        by each rank from its own value: ranks whose shapes differ across that size once
        waited for each other in different meetings for ever.  Now every rank raises the
        shape error at once, nothing changes, and the session goes on."""
        if S.n == 1:
            pytest.skip("one rank: no mismatch possible")
        u = S.u
        vals = [np.full((2, 100_000 if (r == 0) == (large == "rank 0") else 1), r + 1.0) for r in range(S.n)]
        set_all(S, u, vals)
        t0 = time.monotonic()
        for _ in range(2):
            with pytest.raises(ValueError, match="needs the same shape on every rank"):
                synk.all_reduce(u)
        assert time.monotonic() - t0 < 20
        for r in range(S.n):
            check(synk.get_value(r, u), vals[r], "float64")
        set_all(S, u, [np.full((2, 3), r + 1.0) for r in range(S.n)])
        synk.all_reduce(u, op="sum")
        check(synk.gather(u), np.full((S.n, 2, 3), S.n * (S.n + 1) / 2), "float64")

    def test_zero_d_gather(self, S):
        v = S.vs[("int32", 0)]
        parts = [np.int32(10 * r - 3) for r in range(S.n)]
        set_all(S, v, parts)
        check(synk.gather(v), np.array(parts, "int32"), "int32")
        check(synk.gather(v, nd_up=1), np.array(parts, "int32"), "int32")
        with pytest.raises(ValueError, match="0-d"):
            synk.gather(v, nd_up=0)
        with pytest.raises(ValueError, match="0-d"):
            synk.all_gather(v)
        with pytest.raises(ValueError, match="0-d"):
            synk.get_lengths(v)
        with pytest.raises(ValueError, match="0-d"):
            synk.scatter(v, np.arange(3, dtype="int32"))
        assert synk.get_shapes(v) == [()] * S.n

    # ---- interleavings with function calls ------------------------------------------------

    def test_all_reduce_uses_storage_replaced_by_updates(self, S):
        """f's update w <- w + sum(x rows of this rank) replaces w's storage with a new array
        in every rank; the collective must read (and then hold) that live value."""
        n = S.n
        w = S.w
        x = np.arange(6 * 4, dtype="float64").reshape(6, 4)
        b = split(6, n)
        start = [np.full(4, float(r + 1)) for r in range(n)]
        set_all(S, w, start)
        before = w.container.storage[0]
        S.f(x)
        assert w.container.storage[0] is not before                # storage replaced
        model = [start[r] + x[b[r]:b[r + 1]].sum(0) for r in range(n)]
        synk.all_reduce(w, op="sum")
        want = np.sum(model, axis=0)
        for r in range(n):
            check(synk.get_value(r, w), want, "float64", f"rank {r}")
        S.f(x)                                                      # again from the slot value
        model = [want + x[b[r]:b[r + 1]].sum(0) for r in range(n)]
        for r in range(n):
            check(synk.get_value(r, w), model[r], "float64", f"rank {r} after second call")

    def test_growing_values_free_replaced_buffers(self, S):
        """A variable that grows and alternates with fresh values (a gradient replaced by
        every call): its replaced buffers are unmapped, in the master too (a removed
        segment that stays mapped keeps its memory)."""
        v = S.vs[("float64", 1)]
        before = tu.deleted_mappings()
        for size in (1000, 30000, 300000, 700000):
            for k in range(3):
                set_all(S, v, [np.full(size, float(r + k)) for r in range(S.n)])
                synk.all_reduce(v, "sum")
                assert np.array_equal(synk.get_value(S.n - 1, v), np.full(size, float(sum(range(S.n)) + S.n * k)))
        set_all(S, v, [np.zeros(SHAPES[1])] * S.n)
        synk.all_reduce(v, "sum")
        assert tu.deleted_mappings() <= before

    def test_random_interleavings(self, S):
        """A seeded random program of function calls and collectives, mirrored in numpy."""
        n, w, u, f = S.n, S.w, S.u, S.f
        rng = np.random.default_rng(99 + n)
        mw = [rng.standard_normal(4) for _ in range(n)]          # model of w on each rank
        mu = [rng.standard_normal((2, 3)) for _ in range(n)]     # model of u on each rank
        set_all(S, w, mw)
        set_all(S, u, mu)
        reducers = {"avg": lambda s: s.mean(0), "sum": lambda s: s.sum(0), "prod": lambda s: s.prod(0),
                    "max": lambda s: s.max(0), "min": lambda s: s.min(0)}
        for step in range(60):
            k = rng.integers(0, 11)
            if k <= 2:                                           # function call, update replaces w
                rows = int(rng.integers(n, 3 * n + 1))
                x = rng.standard_normal((rows, 4))
                b = split(rows, n)
                out = f(x)
                assert np.isclose(out, sum(m.sum() for m in mu))
                mw = [mw[r] + x[b[r]:b[r + 1]].sum(0) for r in range(n)]
            elif k == 3:
                op = str(rng.choice(OPS))
                synk.all_reduce([w, u], op=op)
                rw, ru = reducers[op](np.stack(mw)), reducers[op](np.stack(mu))
                mw, mu = [rw.copy() for _ in range(n)], [ru.copy() for _ in range(n)]
            elif k == 4:
                op = str(rng.choice(OPS))
                if rng.integers(0, 2):
                    synk.reduce(w, op=op)
                    mw[0] = reducers[op](np.stack(mw))
                else:
                    res = synk.reduce(w, op=op, in_place=False)
                    close(res, reducers[op](np.stack(mw)))
            elif k == 5:
                if rng.integers(0, 2):
                    synk.broadcast(w)
                    mw = [mw[0].copy() for _ in range(n)]
                else:
                    val = rng.standard_normal((2, 3))
                    synk.broadcast(u, val)
                    mu = [val.copy() for _ in range(n)]
            elif k == 6:
                r = int(rng.integers(0, n))
                val = rng.standard_normal(4)
                synk.set_value(r, w, val)
                mw[r] = val
            elif k == 7:
                r = int(rng.integers(0, n))
                close(synk.get_value(r, w), mw[r])
                close(synk.get_value(r, u), mu[r])
            elif k == 8:
                close(synk.gather(w), np.stack(mw))
            elif k == 9:                                         # master-local change
                val = rng.standard_normal(4)
                w.set_value(val)
                mw[0] = val
            else:                                                # u: scatter + all_gather round trip
                full = np.concatenate(mu) if n == 1 else rng.standard_normal((2 * n, 3))
                synk.scatter(u, full)
                synk.all_gather(u)
                mu = [full.copy() for _ in range(n)]
                if len(full) != 2:
                    synk.broadcast(u, mu[0][:2])
                    mu = [mu[0][:2].copy() for _ in range(n)]
        for r in range(n):
            close(synk.get_value(r, w), mw[r])
            close(synk.get_value(r, u), mu[r])

    # ---- errors: raised in the master, before any worker is involved ----------------------

    def test_errors_before_any_worker(self, S):
        v = S.vs[("float32", 1)]
        sent = tu.CommandCounter()
        if True:
            with pytest.raises(ValueError, match="rank"):
                synk.get_value(S.n, v)
            with pytest.raises(ValueError, match="rank"):
                synk.set_value(-1, v, np.zeros(5, "float32"))
            with pytest.raises(ValueError, match="rank"):
                synk.get_value(True, v)
            with pytest.raises(ValueError, match="rank"):
                synk.get_value(0.0, v)
            with pytest.raises(ValueError, match="not a shared variable of any distributed"):
                synk.all_reduce(S.unknown)
            with pytest.raises(ValueError, match="not a shared variable of any distributed"):
                synk.gather([v, S.unknown])
            with pytest.raises(ValueError, match="not a shared variable of any distributed"):
                synk.get_value(0, "v_float32_1")
            with pytest.raises(ValueError, match="more than once"):
                synk.all_reduce([v, v])
            with pytest.raises(ValueError, match="more than once"):
                synk.broadcast((v, v), [np.zeros(5, "float32")] * 2)
            with pytest.raises(ValueError, match="reduce op"):
                synk.all_reduce(v, op="mean")
            with pytest.raises(ValueError, match="reduce op"):
                synk.reduce(v, op="gather")
            with pytest.raises(ValueError, match="nd_up"):
                synk.gather(v, nd_up=2)
            with pytest.raises(ValueError, match="no shared variables"):
                synk.all_reduce([])
            with pytest.raises(TypeError):
                synk.set_value(0, v, np.zeros(5, "float64"))         # unsafe cast
            with pytest.raises(TypeError):
                synk.broadcast(v, np.zeros((2, 2), "float32"))       # wrong ndim
            with pytest.raises(TypeError):
                synk.broadcast([v, S.w], [np.zeros(5, "float32")])   # one value short
            with pytest.raises(TypeError):
                synk.scatter(v, synk.data(np.zeros(4, "float64")))   # Data of another dtype
            with pytest.raises(IndexError):
                synk.scatter(v, np.zeros(4, "float32"), batch=slice(0, 9))
            with pytest.raises(IndexError):
                synk.set_value(0, v, np.zeros(4, "float32"), batch=[0, 4])
            assert sent.n() == 0
        parts = values_for("sum", "float32", (5,), S.n, S.rng)      # and everything works after
        set_all(S, v, parts)
        synk.all_reduce(v, op="sum")
        check(synk.gather(v), np.stack([expected("sum", parts, "float32")] * S.n), "float32")

    def test_not_a_shared_variable_message(self, S):
        """A numpy array given for a shared variable: the message says what was expected and
        shows the type and shape, never the values."""
        arr = np.arange(100_000.0)
        with pytest.raises(ValueError) as ei:
            synk.all_reduce(arr)
        msg = str(ei.value)
        assert "expected a PyTensor shared variable" in msg and "ndarray of shape (100000,)" in msg
        assert len(msg) < 400 and "99999" not in msg

    def test_unknown_variable_message_is_clear(self, S):
        with pytest.raises(ValueError) as e:
            synk.broadcast(S.unknown)
        msg = str(e.value)
        assert "not_in_any_function" in msg and "synk.function" in msg and "distribute" in msg


# ---- the reduction kernel on its own (no processes) -----------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("op", OPS)
def test_reduce_chunk_aliasing_patterns(n, op):
    """Every way ranks call the kernel: destinations that are some of the sources (all_reduce,
    in-place reduce into any master rank), a separate destination, chunk edges anywhere."""
    from synkhronos.backends.shm import chunks as co    # the shm backend's kernel
    rng = np.random.default_rng(n)
    size = 3 * (co._BLOCK_BYTES // 4) + 17
    for dt in ("float32", "float16", "int16", "uint8", "bool"):
        dtype = np.dtype(dt)
        parts = values_for(op, dt, (size,), n, rng)
        want = expected(op, parts, dt)
        cases = [("all", None)] + [("into", m) for m in range(n)] + [("separate", None)]
        for kind, m in cases:
            bufs = [p.copy() for p in parts]
            out = np.zeros(size, dtype)
            bounds = co.chunk_bounds(size, n, dtype.itemsize)
            assert bounds[0] == 0 and bounds[-1] == size and list(bounds) == sorted(bounds)
            for r in range(n):          # ranks one after the other: each chunk exactly once
                dsts = bufs if kind == "all" else [bufs[m]] if kind == "into" else [out]
                co.reduce_chunk(op, bufs, dsts, bounds[r], bounds[r + 1], dtype)
            got = [out] if kind == "separate" else bufs if kind == "all" else [bufs[m]]
            for g in got:
                check(g, want, dt, f"{op} {dt} n={n} {kind} {m}")
            if kind == "into":
                for r in range(n):
                    if r != m:
                        check(bufs[r], parts[r], dt, f"{op} {dt} source {r} untouched")
