"""Property-based fuzzing (hypothesis): random small graphs, shapes, dtypes (float32, float64,
int32), selectors, slice counts, output reduce modes, updates, collectives and n_parallel in
1..3; every result is compared with serial PyTensor.

One hypothesis example is one whole session: fork(n), 1-2 random graphs turned into
synkhronos functions (with a random subset of outputs in every reduce mode, and sometimes an
update of a shared variable), distribute, then several random calls of each (numpy or Data
inputs, batch as None / int / slice / index list with repeats, num_slices 1..4, an
output_subset), each compared with a serial PyTensor function of the same graph compiled
separately, on the selected rows; per-rank update values are checked through
``synk.gather``, and a random all_reduce / reduce of the shared variable against numpy.

``test_fuzz_short`` runs a few examples per n_parallel in CI (no shrinking: every example
is a session, so shrinking a failure would take minutes; the failing example is printed
and can be replayed); ``test_fuzz_long`` (``slow``) runs many more, and shrinks.
The numbers of examples, calls and comparisons are printed at the end."""
import numpy as np
import pytest
import pytensor
import pytensor.tensor as T
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import synkhronos as synk
import synk_testutil as tu
from synkhronos.shards import split

STATS = {"examples": 0, "graphs": 0, "calls": 0, "compared": 0, "collectives": 0,
         "by_n": {1: 0, 2: 0, 3: 0}}

UNARY = {"neg": (lambda a: -a, np.negative), "abs": (abs, np.abs),
         "tanh": (T.tanh, np.tanh), "sqr": (T.sqr, np.square), "sin": (T.sin, np.sin)}
BINARY = {"add": (lambda a, b: a + b, np.add), "sub": (lambda a, b: a - b, np.subtract),
          "mul": (lambda a, b: a * b, np.multiply), "max": (T.maximum, np.maximum),
          "min": (T.minimum, np.minimum)}
OUTPUT_KINDS = ["sum", "mean", "max", "min", "prod", "rows", "mat", "colmean", "none"]
NEEDS_ROWS = {"max", "min"}          # serial PyTensor raises on an empty batch for these


@pytest.fixture(scope="module", autouse=True)
def _print_stats(request):
    yield
    if STATS["examples"]:
        tu.report(request.config, f"\nfuzz: {STATS['examples']} examples (sessions by n_parallel "
                  f"{STATS['by_n']}), {STATS['graphs']} graphs, {STATS['calls']} calls, "
                  f"{STATS['compared']} outputs compared with serial PyTensor, "
                  f"{STATS['collectives']} collectives compared with numpy")


# ---- strategies --------------------------------------------------------------------------------

def trees(depth):
    leaf = st.sampled_from([("x",), ("y",), ("c", 0.5), ("c", -1.25), ("x",)])
    if depth == 0:
        return leaf
    sub = trees(depth - 1)
    return st.one_of(leaf,
                     st.tuples(st.just("u"), st.sampled_from(sorted(UNARY)), sub),
                     st.tuples(st.just("b"), st.sampled_from(sorted(BINARY)), sub, sub))


graph_specs = st.fixed_dictionaries({
    "dtype": st.sampled_from(["float32", "float64", "int32"]),
    "cols": st.integers(1, 3),
    "tree": trees(3),
    "outputs": st.lists(st.sampled_from(OUTPUT_KINDS), min_size=1, max_size=4, unique=True),
    "update": st.booleans(),
})


def has_x(tree):
    return tree[0] == "x" or any(has_x(t) for t in tree[1:] if isinstance(t, tuple))


def build_expr(tree, x, y):
    kind = tree[0]
    if kind == "x":
        return x
    if kind == "y":
        return y
    if kind == "c":
        return T.constant(np.asarray(tree[1], dtype=x.dtype))
    if kind == "u":
        return UNARY[tree[1]][0](build_expr(tree[2], x, y))
    return BINARY[tree[1]][0](build_expr(tree[2], x, y), build_expr(tree[3], x, y))


def outputs_of(kind, e, y):
    return {"sum": (T.sum(e), "sum"), "mean": (T.mean(e), "avg"), "max": (T.max(e), "max"),
            "min": (T.min(e), "min"), "prod": (T.prod(1 + 0.05 * T.tanh(e)), "prod"),
            "rows": (e.sum(axis=1), "gather"), "mat": (e, "gather"),
            "colmean": (T.mean(e, axis=0), "avg"), "none": (2 * T.sum(y) + 1, None)}[kind]


class Graph:
    def __init__(self, spec, idx):
        self.spec = spec
        dt = spec["dtype"]
        x = T.matrix(f"x{idx}", dtype=dt)
        y = T.vector(f"y{idx}", dtype=dt)
        e = build_expr(spec["tree"], x, y)
        if not has_x(spec["tree"]):
            e = e + x                       # every graph depends on the rows
        e = T.cast(e, dt)
        self.kinds = spec["outputs"]
        outs = [outputs_of(k, e, y) for k in self.kinds]
        self.modes = [m for _, m in outs]
        self.w = None
        updates = None
        colmean = T.cast(T.mean(e, axis=0), dt)
        if spec["update"] and dt != "int32":   # int updates average with rounding over slices
            self.w = pytensor.shared(np.zeros(spec["cols"], dtype=dt), name=f"w{idx}")
            updates = [(self.w, T.cast(self.w * 0.5 + colmean, dt), "avg")]
        self.f = synk.function([x], [o for o in outs], bcast_inputs=[y], updates=updates,
                               on_unused_input="ignore")
        # serial PyTensor, compiled separately (same default mode); colmean last (updates).
        # (Not FAST_COMPILE: PyTensor's own backends disagree on some empty-input cases, e.g.
        # the mean of an empty x * 0 (int32) is 0.0 after the default rewrites, nan without.)
        self.ref = pytensor.function([x, y], [v for v, _ in outs] + [colmean],
                                     on_unused_input="ignore")


def tol(spec_dtype, dtype):
    if np.float32 in (np.dtype(spec_dtype), dtype):     # float32 somewhere in the graph
        return dict(rtol=2e-4, atol=2e-4)
    if dtype.kind in "iub":
        return dict(rtol=0, atol=0)
    return dict(rtol=1e-9, atol=1e-9)


def check_close(got, want, dtype, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), equal_nan=True,
                               err_msg=what, **tol(dtype, want.dtype))
    STATS["compared"] += 1


# ---- one example: one session ---------------------------------------------------------------

def run_example(data, n, specs):
    synk.fork(n)
    try:
        graphs = [Graph(s, i) for i, s in enumerate(specs)]
        synk.distribute()
        STATS["examples"] += 1
        STATS["by_n"][n] += 1
        STATS["graphs"] += len(graphs)
        rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), label="seed"))
        for g in graphs:
            dt, cols = g.spec["dtype"], g.spec["cols"]
            model = [np.zeros(cols, dtype=dt) for _ in range(n)]     # w on every rank
            for call in range(data.draw(st.integers(2, 6), label="calls")):
                length = data.draw(st.integers(0, 13), label="rows")
                if dt == "int32":
                    X = rng.integers(-3, 4, (length, cols)).astype(dt)
                    Y = rng.integers(-3, 4, cols).astype(dt)
                else:
                    X = (rng.standard_normal((length, cols)) * 0.7).astype(dt)
                    Y = (rng.standard_normal(cols) * 0.7).astype(dt)
                kind = data.draw(st.sampled_from(["none", "int", "slice", "index"]), label="batch")
                if kind == "none":
                    batch, rows = None, np.arange(length)
                elif kind == "int":
                    k = data.draw(st.integers(0, length), label="k")
                    batch, rows = k, np.arange(k)
                elif kind == "slice":
                    a = data.draw(st.integers(0, length), label="a")
                    b = data.draw(st.integers(a, length), label="b")
                    batch, rows = slice(a, b), np.arange(a, b)
                else:
                    idx = data.draw(st.lists(st.integers(0, max(length - 1, 0)), max_size=12),
                                    label="idx") if length else []
                    batch, rows = idx, np.asarray(idx, dtype=np.int64)
                if len(rows) == 0 and any(k in NEEDS_ROWS for k in g.kinds):
                    continue
                num_slices = data.draw(st.integers(1, 4), label="num_slices")
                subset = None
                if data.draw(st.booleans(), label="use subset"):
                    subset = data.draw(st.lists(st.integers(0, len(g.kinds) - 1), min_size=1,
                                                unique=True), label="subset")
                as_data = data.draw(st.booleans(), label="Data")
                xin = synk.data(X) if as_data else X
                kw = {} if batch is None else {"batch": batch}
                got = g.f(xin, Y, num_slices=num_slices, output_subset=subset, **kw)
                STATS["calls"] += 1
                Xs = X[rows]
                want = g.ref(Xs, Y)
                order = range(len(g.kinds)) if subset is None else subset
                assert len(got) == len(order)
                for got_i, i in zip(got, order):
                    check_close(got_i, want[i], dt, f"output {g.kinds[i]} ({g.modes[i]}), n={n}, "
                                f"batch={batch!r}, num_slices={num_slices}, spec={g.spec}")
                if g.w is not None:        # every rank with rows updated its own w
                    b = split(len(rows), n)
                    for r in range(n):
                        if b[r + 1] > b[r]:
                            cm = g.ref(Xs[b[r]:b[r + 1]], Y)[-1]
                            model[r] = (model[r] * 0.5 + cm).astype(dt)
                    check_close(synk.gather(g.w), np.stack(model), dt, f"updated w by rank, n={n}")
            if g.w is not None:            # a collective on the updated variable
                vals = [(rng.standard_normal(cols) * 2).astype(dt) for _ in range(n)]  # float
                for r in range(n):
                    synk.set_value(r, g.w, vals[r])
                op = data.draw(st.sampled_from(["sum", "avg", "max", "min", "prod"]), label="op")
                ref = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min,
                       "prod": np.prod}[op](np.stack(vals).astype(np.float64), axis=0).astype(dt)
                if data.draw(st.booleans(), label="all_reduce"):
                    synk.all_reduce(g.w, op=op)
                    check_close(synk.gather(g.w), np.stack([ref] * n), dt, f"all_reduce {op}")
                else:
                    check_close(synk.reduce(g.w, op=op, in_place=False), ref, dt, f"reduce {op}")
                STATS["collectives"] += 1
    finally:
        synk.close()


SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), print_blob=True)


@pytest.mark.parametrize("n", [1, 2, 3])
@settings(max_examples=2, phases=[Phase.explicit, Phase.reuse, Phase.generate], **SETTINGS)
@given(data=st.data(), specs=st.lists(graph_specs, min_size=1, max_size=2))
def test_fuzz_short(n, data, specs):
    run_example(data, n, specs)


@pytest.mark.slow
@pytest.mark.timeout(1500)
@settings(max_examples=80, **SETTINGS)
@given(data=st.data(), n=st.integers(1, 3), specs=st.lists(graph_specs, min_size=1, max_size=2))
def test_fuzz_long(data, n, specs):
    run_example(data, n, specs)
