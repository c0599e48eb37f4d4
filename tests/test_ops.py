"""In-graph collectives (``synkhronos.ops``): values and gradients against the serial graph.

One fork per rank count (n = 1, 2, 3; a class-scoped, parametrized fixture) with every
function built before ``distribute``.  Each case is a per-rank graph on the rank's shard
``x`` (7 rows: unequal shards for n = 2, 3) of the scattered input, a shared ``w`` and
broadcast inputs, and the same computation written serially over the shards of the whole
input ``X`` (no collective: sums, stacks, slices), compiled with PyTensor's Python linker.
Compared: the op's value, the summed cost ``J`` (every rank's cost, summed), its gradient
with respect to ``w`` (summed over ranks: what a data-parallel update uses) and with
respect to the input (each rank's rows, gathered).

Also: the single-rank behaviour outside a call (plain PyTensor, ``as_theano``), ties in
``max``, zeros in ``prod``, ``num_slices``, the C/Python backend, and failures: a shape
mismatch raises on every rank and changes nothing, bad counts, too few rows, a root out of
range, ``mode="JAX"`` refused when the function is made in a CPU session.  The JAX pass
(scripts/test.sh) runs the same cases on JAX CPU ranks."""
import time
import types

import numpy as np
import pytest
import pytensor
import pytensor.tensor as T
from pytensor.compile.mode import Mode
from pytensor.raise_op import Assert

import synk_testutil as tu
import synkhronos as synk
from synkhronos import ops
from synkhronos.shards import split

N, D, M = 7, 3, 5                     # rows of the scattered input, columns, rows to scatter
COUNTS = {1: [5], 2: [1, 4], 3: [2, 0, 3]}   # reduce_scatter counts (sum M), a zero included
SERIAL = Mode(linker="py", optimizer="fast_compile")
RED_SERIAL = {
    "sum": lambda S: sum(S[1:], S[0]),
    "avg": lambda S: sum(S[1:], S[0]) / len(S),
    "prod": lambda S: T.prod(T.stack(S), axis=0),
    "max": lambda S: T.max(T.stack(S), axis=0),
    "min": lambda S: T.min(T.stack(S), axis=0),
}


# ---- the cases: (per-rank graph, serial graph) -----------------------------------------------
# dist(v) -> (J, [(extra output, mode)]); serial(v, shards) -> (J, [extra]); ``v`` holds the
# symbolic inputs (x or X, w, c, A, C, cnt); ``shards`` are X's rows of each rank.

def _s(v, x):
    return T.tanh(x * v.w).sum(axis=0)


def case_all_reduce(op):
    def dist(v):
        s = _s(v, v.x)
        y = ops.all_reduce(s, op)
        return T.sum(y * v.c) + T.sum(y * s), [(y, None)]

    def serial(v, shards, n):
        S = [_s(v, xs) for xs in shards]
        y = RED_SERIAL[op](S)
        return sum(T.sum(y * v.c) + T.sum(y * s) for s in S), [y]
    return dist, serial


def case_all_gather():
    def dist(v):
        F = ops.all_gather(T.tanh(v.x * v.w))
        return T.sum(F * v.C) * T.sum(v.x), [(F, None)]

    def serial(v, shards, n):
        F = T.tanh(v.X * v.w)
        return sum(T.sum(F * v.C) * T.sum(xs) for xs in shards), [F]
    return dist, serial


def case_reduce_scatter(op, counts):
    def dist(v):
        s = _s(v, v.x)
        y = ops.reduce_scatter(T.tanh(v.A * s), op, counts=v.cnt if counts else None)
        return T.sum(y ** 2) * T.sum(s), [(y, "gather")]

    def serial(v, shards, n):
        S = [_s(v, xs) for xs in shards]
        Z = RED_SERIAL[op]([T.tanh(v.A * s) for s in S])
        if counts:
            b = T.concatenate([T.zeros(1, "int64"), T.cumsum(v.cnt)])
        else:
            b = [(r * v.A.shape[0]) // n for r in range(n + 1)]
        return sum(T.sum(Z[b[r]:b[r + 1]] ** 2) * T.sum(s) for r, s in enumerate(S)), [Z]
    return dist, serial


def case_broadcast(root):
    def dist(v):
        s = _s(v, v.x)
        y = ops.broadcast(s, root)
        return T.sum(y * s) + T.sum(y * v.c), [(y, None)]

    def serial(v, shards, n):
        S = [_s(v, xs) for xs in shards]
        y = S[root]
        return sum(T.sum(y * s) + T.sum(y * v.c) for s in S), [y]
    return dist, serial


def case_reduce(op, root):
    def dist(v):
        s = _s(v, v.x)
        y = ops.reduce(s, op, root)
        return T.sum(y * v.c) + T.sum(y * s), [(y, "gather")]

    def serial(v, shards, n):
        S = [_s(v, xs) for xs in shards]
        y = RED_SERIAL[op](S)
        per_rank = [y if r == root else T.zeros_like(y) for r in range(n)]
        return T.sum(y * v.c) + T.sum(y * S[root]), [T.concatenate(per_rank)]
    return dist, serial


def case_max_tie():
    """Every rank holds the same value (the shared w): each tied rank gets the gradient."""
    def dist(v):
        y = ops.all_reduce(v.w * 1.0, "max")
        return T.sum(y * v.c) * T.sum(_s(v, v.x)), [(y, None)]

    def serial(v, shards, n):
        y = T.max(T.stack([v.w * 1.0] * n), axis=0)
        return sum(T.sum(y * v.c) * T.sum(_s(v, xs)) for xs in shards), [y]
    return dist, serial


CASES = {f"all_reduce_{op}": case_all_reduce(op) for op in ("sum", "avg", "max", "min", "prod")}
CASES["all_gather"] = case_all_gather()
for _op in ("sum", "avg", "max"):
    CASES[f"reduce_scatter_{_op}"] = case_reduce_scatter(_op, False)
    CASES[f"reduce_scatter_{_op}_counts"] = case_reduce_scatter(_op, True)
CASES["broadcast_0"] = case_broadcast(0)
CASES["broadcast_1"] = case_broadcast(1)
CASES["reduce_sum_0"] = case_reduce("sum", 0)
CASES["reduce_max_0"] = case_reduce("max", 0)
CASES["reduce_sum_1"] = case_reduce("sum", 1)
CASES["max_tie"] = case_max_tie()


def symbols():
    return types.SimpleNamespace(x=T.matrix("x"), X=T.matrix("X"), c=T.vector("c"), A=T.matrix("A"),
                                 C=T.matrix("C"), cnt=T.lvector("cnt"))


def build(v, name):
    dist, _ = CASES[name]
    J, extra = dist(v)
    gw, gx = pytensor.grad(J, [v.w, v.x])
    outs = [(J, "sum"), (gw, "sum"), (gx, "gather")] + extra
    return synk.function([v.x], outs, bcast_inputs=[v.c, v.A, v.C, v.cnt], on_unused_input="ignore", name=name)


def serial_fn(v, name, n, slices=1, rows=N):
    """The serial graph of ``rows`` scattered rows; with ``slices``, the sum over the slices
    (each rank's rows cut in ``slices`` pieces, the collectives combining the ranks' k-th
    pieces)."""
    _, ser = CASES[name]
    b = split(rows, n)
    Js, extra = [], []
    for k in range(slices):
        shards = []
        for r in range(n):
            p = split(b[r + 1] - b[r], slices, b[r])
            shards.append(v.X[p[k]:p[k + 1]])
        J, ex = ser(v, shards, n)
        Js.append(J)
        extra = ex                       # mode None outputs: the last slice's
    J = sum(Js[1:], Js[0])
    gw, gX = pytensor.grad(J, [v.w, v.X])
    return pytensor.function([v.X, v.c, v.A, v.C, v.cnt], [J, gw, gX] + extra, mode=SERIAL,
                             on_unused_input="ignore")


@pytest.fixture(scope="class", params=[1, 2, 3], ids=["n1", "n2", "n3"])
def S(request):
    n = request.param
    rng = np.random.default_rng(42 + n)
    synk.fork(n_parallel=n)
    try:
        w = pytensor.shared(rng.uniform(0.5, 1.5, D), name="w")
        v = symbols()
        v.w = w
        fs = {name: build(v, name) for name in CASES}
        # failures
        u = pytensor.shared(np.zeros(D), name="u")
        x = v.x
        mismatch = synk.function([x], (T.sum(ops.all_reduce(x.sum(axis=1))), "sum"),
                                 updates=[(u, u + ops.all_reduce(x.sum(axis=0)))])
        good = synk.function([x], (ops.all_reduce(x.sum(axis=0), "sum"), None), updates=[(u, u + 1)])
        # fails on the last rank only, after its in-graph all_reduce completed everywhere
        total = ops.all_reduce(x.sum(axis=0), "sum")
        late_fail = synk.function([x], (T.sum(total), "sum"), updates=[(u, Assert("the last rank fails")(
            u + total, T.neq(ops.this_rank(), ops.n_ranks() - 1)))])
        # one graph, every op, on values from a few bytes to far past the small-message size
        sized = synk.function([x], [(ops.all_reduce(T.sum(x) * v.c, op), None) for op in RED_SERIAL],
                              bcast_inputs=[v.c])
        big_mismatch = synk.function([x], (T.sum(ops.all_reduce(T.repeat(x.sum(axis=1), 20000))), "sum"),
                                     updates=[(u, u + 1)])
        # rank 0's value a few bytes, the others' far past the small-message size (which
        # decides how an all-reduce goes, on each rank from its own value)
        size = T.switch(T.eq(ops.this_rank(), 0), 3, 90000)
        straddling = synk.function([x], (T.sum(ops.all_reduce(T.sum(x) * T.ones((size,)))), "sum"),
                                   updates=[(u, u + 1)])
        info = synk.function([x], (T.stack([ops.this_rank(), ops.n_ranks()]), "gather"),
                             on_unused_input="ignore")
        perform = None if tu.jax_backend() else synk.function([x], (ops.all_reduce(x.sum(axis=0)), None),
                                                               mode="FAST_COMPILE")
        try:
            synk.function([x], ops.all_reduce(x), mode="JAX")
            jax_error = None
        except TypeError as e:
            jax_error = str(e)
        synk.distribute()
        data = dict(X=rng.standard_normal((N, D)), c=rng.standard_normal(D), A=rng.standard_normal((M, D)),
                    C=rng.standard_normal((N, D)), cnt=np.asarray(COUNTS[n], np.int64))
        yield types.SimpleNamespace(n=n, v=v, w=w, u=u, fs=fs, data=data, mismatch=mismatch, good=good,
                                    late_fail=late_fail, sized=sized, big_mismatch=big_mismatch,
                                    straddling=straddling,
                                    info=info, perform=perform, jax_error=jax_error, serial={})
    finally:
        synk.close()


def args(S, X=None):
    d = S.data
    return (d["X"] if X is None else X, d["c"], d["A"], d["C"], d["cnt"])


def compare(S, name, X=None, data=None, **call):
    """``S.fs[name]`` against its serial graph on ``S.data`` (``X``, ``data``: other values)."""
    d = dict(S.data, **(data or {}))
    if X is not None:
        d["X"] = X
    given = (d["X"], d["c"], d["A"], d["C"], d["cnt"])
    key = (name, call.get("num_slices", 1), len(d["X"]))
    if key not in S.serial:
        S.serial[key] = serial_fn(S.v, name, S.n, call.get("num_slices", 1), rows=len(d["X"]))
    got = S.fs[name](*given, **call)
    want = S.serial[key](*given)
    labels = ["J", "dJ/dw", "dJ/dx", "value"][:3 if "num_slices" in call else 4]   # (values: per slice)
    for g, e, what in zip(got, want, labels):
        np.testing.assert_allclose(g, e, rtol=1e-9, atol=1e-9, err_msg=f"{name} n={S.n}: {what}")
    return got


class TestOps:

    @pytest.mark.parametrize("name", [k for k in CASES if not k.endswith("_1")])
    def test_value_and_gradients(self, S, name):
        compare(S, name)

    @pytest.mark.parametrize("name", ["broadcast_1", "reduce_sum_1"])
    def test_root_1(self, S, name):
        if S.n == 1:
            with pytest.raises(ValueError, match="root 1 is out of range for 1 rank"):
                S.fs[name](*args(S))
        else:
            compare(S, name)

    def test_prod_with_zeros(self, S):
        """A rank whose value is 0: the product is 0, its gradient the others' product."""
        X = S.data["X"].copy()
        X[:split(N, S.n)[1]] = 0.0
        got = compare(S, "all_reduce_prod", X=X)
        if S.n > 1:
            assert np.all(got[3] == 0) and np.any(got[2] != 0)

    def test_num_slices(self, S):
        compare(S, "all_reduce_sum", num_slices=2)
        compare(S, "reduce_scatter_sum", num_slices=2)

    def test_rank_info(self, S):
        got = S.info(S.data["X"])
        np.testing.assert_array_equal(got, np.ravel([[r, S.n] for r in range(S.n)]))
        np.testing.assert_array_equal(S.info.as_theano(S.data["X"]), [0, 1])

    def test_outside_a_call_acts_as_one_rank(self, S):
        """as_theano: every op as a single rank (the n = 1 serial graph)."""
        ref = serial_fn(S.v, "all_gather", 1)
        for g, e in zip(S.fs["all_gather"].as_theano(*args(S)), ref(*args(S))):
            np.testing.assert_allclose(g, e, rtol=1e-9, atol=1e-9)

    def test_python_backend(self, S):
        np.testing.assert_allclose(S.perform(S.data["X"]), S.data["X"].sum(axis=0), rtol=1e-12)

    @pytest.mark.parametrize("size", [1, 1000, 9000, 100_000])
    def test_small_and_large_values(self, S, size):
        """Small values take a one-meeting path, large ones the chunked one: both give
        numpy's reduction of the ranks' values (exactly, for 3 ranks or fewer)."""
        X = S.data["X"]
        c = np.random.default_rng(size).standard_normal(size)
        b = split(N, S.n)
        parts = [X[b[r]:b[r + 1]].sum() * c for r in range(S.n)]
        np_red = {"sum": lambda p: sum(p[1:], p[0]), "avg": lambda p: sum(p[1:], p[0]) * (1.0 / len(p)),
                  "prod": lambda p: np.prod(p, axis=0), "max": lambda p: np.max(p, axis=0),
                  "min": lambda p: np.min(p, axis=0)}
        for op, got in zip(RED_SERIAL, S.sized(X, c)):
            np.testing.assert_allclose(got, np_red[op](parts), rtol=1e-14, atol=0, err_msg=f"{op} size {size}")

    @pytest.mark.parametrize("which", ["small", "large", "straddling"])
    def test_shape_mismatch_raises_everywhere_and_changes_nothing(self, S, which):
        """Every rank raises the shape error (the master its own, from the worker's), for
        small values, large ones and values on both sides of the small-message size; once
        raced: a rank that passed the meeting, saw the shapes and aborted before the master
        looked again left the master Aborted instead (so only the worker's error came)."""
        if S.n == 1:
            pytest.skip("one rank: no mismatch possible")
        before = [synk.get_value(r, S.u) for r in range(S.n)]
        f = dict(small=S.mismatch, large=S.big_mismatch, straddling=S.straddling)[which]
        with pytest.raises(ValueError, match="needs the same shape on every rank") as ei:
            f(S.data["X"])                   # shards of unequal lengths
        cause = ei.value.__cause__
        assert isinstance(cause, synk.WorkerError) and cause.ranks == list(range(1, S.n))
        assert all("needs the same shape on every rank" in t for t in cause.errors.values())
        for r in range(S.n):
            np.testing.assert_array_equal(synk.get_value(r, S.u), before[r])
        # the session goes on: the next call works and commits its updates everywhere
        np.testing.assert_allclose(S.good(S.data["X"]), S.data["X"].sum(axis=0), rtol=1e-12)
        for r in range(S.n):
            np.testing.assert_array_equal(synk.get_value(r, S.u), before[r] + 1)

    def test_failure_after_the_collective_applies_nothing(self, S):
        """In-graph collectives skip the all-or-nothing vote (their results are a call's own
        values): a rank that fails after one has completed still leaves every rank's
        variables unchanged, and the session goes on."""
        if S.n == 1:
            pytest.skip("one rank: it fails alone")
        before = [synk.get_value(r, S.u) for r in range(S.n)]
        with pytest.raises(synk.WorkerError, match="the last rank fails") as ei:
            S.late_fail(S.data["X"])
        assert ei.value.ranks == [S.n - 1]
        for r in range(S.n):
            np.testing.assert_array_equal(synk.get_value(r, S.u), before[r])
        S.good(S.data["X"])
        for r in range(S.n):
            np.testing.assert_array_equal(synk.get_value(r, S.u), before[r] + 1)

    def test_bad_counts(self, S):
        d = dict(S.data)
        bad = np.asarray(COUNTS[S.n], np.int64) + 1          # sums to more than M rows
        with pytest.raises(ValueError, match="counts"):
            S.fs["reduce_scatter_sum_counts"](d["X"], d["c"], d["A"], d["C"], bad)
        compare(S, "reduce_scatter_sum_counts")               # and it still works

    def test_too_few_rows(self, S):
        with pytest.raises(ValueError, match="in-graph collectives"):
            S.fs["all_reduce_sum"](*args(S, S.data["X"][:S.n - 1]))
        with pytest.raises(ValueError, match="num_slices"):
            S.fs["all_reduce_sum"](*args(S, S.data["X"][:2 * S.n - 1]), num_slices=2)

    def test_jax_mode(self, S):
        """mode="JAX": refused when made in a CPU session (numba ranks cannot run a JAX graph
        around the ops); a JAX session compiles it (in stretches between the ops)."""
        if tu.jax_backend():
            assert S.jax_error is None
        else:
            assert S.jax_error is not None and "JAX" in S.jax_error and "synkhronos.ops" in S.jax_error


# ---- collectives inside a scan -----------------------------------------------------------------

def test_collectives_inside_scan():
    """A ``scan`` whose step holds an in-graph all-reduce of a value that changes every
    step (so it stays inside the loop): the call runs on every rank at once (it once ran
    the master's share first, as for a graph without collectives, and waited for ever in
    the first collective), its value is the serial one, and so are the next calls (its
    thousands of meetings once ran past the tokens of one command into the next one's).
    A scan whose length differs between the ranks (over a rank's own rows) raises on the
    rank left waiting, instead of waiting for ever, and applies nothing.  Under JAX such
    graphs are refused when they are made."""
    steps, width = 2100, 30000            # every step far past the small-message size
    x = T.matrix("x")
    v = x.sum(axis=0)
    total = pytensor.scan(lambda i, acc: acc + ops.all_reduce(T.repeat(v * i, width // 3)),
                          sequences=[T.arange(1, steps + 1, dtype="float64")],
                          outputs_info=[T.zeros((width,), "float64")], return_updates=False)
    once = ops.all_reduce(T.repeat(v, width // 3))
    rows = pytensor.scan(lambda row, acc: acc + ops.all_reduce(row), sequences=[x],
                         outputs_info=[T.zeros((3,), "float64")], return_updates=False)
    tu.fork(2)
    try:
        if tu.jax_backend():
            with pytest.raises(TypeError, match="inside a scan"):
                synk.function([x], (total[-1], None))
            return
        u = pytensor.shared(np.zeros(3), name="u_scan")
        f = synk.function([x], (total[-1], None))
        g = synk.function([x], (once, None))
        uneven = synk.function([x], (rows[-1], None), updates=[(u, u + 1)])
        synk.distribute()
        X = np.random.default_rng(5).standard_normal((8, 3))
        want = steps * (steps + 1) / 2 * np.repeat(X.sum(axis=0), width // 3)
        np.testing.assert_allclose(f(X), want, rtol=1e-9)
        for seed in range(6, 12):
            X = np.random.default_rng(seed).standard_normal((8, 3))
            np.testing.assert_allclose(g(X), np.repeat(X.sum(axis=0), width // 3), rtol=1e-12)
        for X in (np.ones((7, 3)), np.ones((7, 3))):          # rank 0: 3 rows, rank 1: 4
            t0 = time.monotonic()
            with pytest.raises(synk.WorkerError, match="different numbers of collectives"):
                uneven(X)
            assert time.monotonic() - t0 < 30
        assert [synk.get_value(r, u).tolist() for r in range(2)] == [[0.0] * 3] * 2
        np.testing.assert_allclose(g(X), np.repeat(X.sum(axis=0), width // 3), rtol=1e-12)
    finally:
        synk.close()


# ---- no session -------------------------------------------------------------------------------

def test_plain_pytensor_single_rank():
    """Without synkhronos running, each op is what one rank computes (identity etc.), with
    PyTensor's default (numba) backend and gradients."""
    x = T.matrix("x")
    w = pytensor.shared(np.array([1.0, 2.0, 3.0]), name="w_plain")
    y = x * w
    outs = [ops.all_reduce(y, "max"), ops.all_gather(y), ops.reduce_scatter(y, "sum", counts=[4]),
            ops.broadcast(y), ops.reduce(y), ops.all_reduce(y, "prod")]
    cost = sum(T.sum(o ** 2) for o in outs) * ops.n_ranks() + ops.this_rank()
    f = pytensor.function([x], outs + [cost] + pytensor.grad(cost, [x, w]))
    X = np.arange(12.0).reshape(4, 3)
    res = f(X)
    Y = X * [1.0, 2.0, 3.0]
    for o in res[:6]:
        np.testing.assert_allclose(o, Y)
    np.testing.assert_allclose(res[6], 6 * np.sum(Y ** 2))
    np.testing.assert_allclose(res[7], 12 * Y * [1.0, 2.0, 3.0])
    np.testing.assert_allclose(res[8], 12 * (Y * X).sum(axis=0))


def test_graph_errors():
    with pytest.raises(TypeError, match="at least 1 dimension"):
        ops.all_gather(T.scalar())
    with pytest.raises(TypeError, match="at least 1 dimension"):
        ops.reduce_scatter(T.scalar())
    with pytest.raises(ValueError, match="invalid all_reduce op"):
        ops.all_reduce(T.vector(), "mean")
    with pytest.raises(ValueError, match="root"):
        ops.broadcast(T.vector(), root=-1)
    with pytest.raises(TypeError, match="counts"):
        ops.reduce_scatter(T.vector(), counts=T.vector())
    ops.check_backend("FAST_COMPILE")
    ops.check_backend(None, types.SimpleNamespace(placement="host", kind="cpu"))
    with pytest.raises(TypeError, match="JAXLinker"):
        ops.check_backend("JAX")
    with pytest.raises(TypeError, match="keeps arrays on 'device'"):
        ops.check_backend(None, types.SimpleNamespace(placement="device", kind="jax"))
    f = pytensor.function([], ops.reduce_scatter(T.ones(3), counts=[1, 2]))
    with pytest.raises(ValueError, match="do not fit one rank"):
        f()
