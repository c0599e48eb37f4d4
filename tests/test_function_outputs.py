"""Function outputs: every reduce mode against serial PyTensor, even and uneven shards,
gather order, avg weighting, mode None, numpy vs Data inputs, inputs by name, return
types, output_subset, num_slices and updates applied locally.

One fork per rank count (n=2 and n=3; the module fixture is parametrized), all functions
built before a single distribute(); graphs are tiny and shared with other modules so that
the numba JIT cache is reused."""
import types

import numpy as np
import pytest
import pytensor as theano
import pytensor.tensor as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import synkhronos as synk
import synk_testutil as tu

MODES = ["avg", "sum", "prod", "max", "min", "gather", None, "gather", "gather"]
I_AVG, I_SUM, I_PROD, I_MAX, I_MIN, I_GATHER, I_NONE, I_COUNTS, I_PARTIAL = range(9)
LENGTHS = [1, 2, 3, 4, 5, 6, 7, 12]


@pytest.fixture(scope="module", params=[2, 3], ids=["n2", "n3"])
def S(request):
    n = tu.fork(request.param)
    assert n == request.param
    try:
        x = T.matrix("x", dtype="float32")
        outs = [T.mean(x, axis=0), T.sum(x, axis=0), T.prod(x, axis=0), T.max(x, axis=0),
                T.min(x, axis=0), 2 * x, T.sum(x, axis=0), x.shape[0], T.sum(x)]
        f_red = synk.function([x], [(o, m) for o, m in zip(outs, MODES)])
        serial = theano.function([x], outs)

        # the introductory example's graph: single output vs list output
        xm = T.matrix("x", dtype="float32")
        y = T.vector("y", dtype="float32")
        z = T.mean(xm.dot(y), axis=0)
        g_single = synk.function([xm], z, bcast_inputs=[y])
        g_list = synk.function([xm], [z], bcast_inputs=[y])
        g_sum = synk.function([xm], (z, "sum"), bcast_inputs=[y])
        g_serial = theano.function([xm, y], z)

        # two scattered inputs
        a = T.vector("a", dtype="float32")
        b = T.vector("b", dtype="float32")
        f7 = synk.function([a, b], (T.sum(a * b), "sum"))

        # a scattered input and a 0-d broadcast input
        a8 = T.vector("a", dtype="float32")
        c8 = T.scalar("c", dtype="float32")
        f8 = synk.function([a8], (T.sum(a8 * c8), "sum"), bcast_inputs=[c8])

        # the docs' shared-variable example: updates only, applied locally in each rank
        s = theano.shared(np.ones(2, dtype="float32"), name="s")
        xu = T.matrix("x", dtype="float32")
        f_upd = synk.function([xu], updates=[(s, T.sum(xu * s, axis=0))])

        # update mode "share" (a gradient's): the rank's mean scaled by its share of the rows
        sh = theano.shared(np.zeros(3, dtype="float64"), name="sh")
        xs = T.matrix("x", dtype="float64")
        f_share = synk.function([xs], updates=[(sh, T.mean(xs, axis=0), "share")])

        synk.distribute()
        yield types.SimpleNamespace(n=n, f_red=f_red, serial=serial, g_single=g_single,
                                    g_list=g_list, g_sum=g_sum, g_serial=g_serial, f7=f7,
                                    f8=f8, s=s, f_upd=f_upd, sh=sh, f_share=f_share)
    finally:
        synk.close()


def _data(L, cols=3, seed=0):
    rng = np.random.default_rng(seed + 1000 * L)
    return rng.uniform(0.5, 1.5, size=(L, cols)).astype(np.float32)


def _check_counts(counts, L, n):
    counts = np.asarray(counts)
    assert counts.dtype.kind in "iu"
    assert len(counts) == min(n, L), "one gathered entry per rank with a non-empty shard"
    assert counts.sum() == L
    assert counts.min() >= 1 and counts.max() - counts.min() <= 1, f"shards not near-equal: {counts}"
    return counts


def _shards(X, counts):
    edges = np.concatenate([[0], np.cumsum(counts)])
    return [X[edges[i]:edges[i + 1]] for i in range(len(counts))]


@pytest.mark.parametrize("L", LENGTHS)
def test_every_reduce_mode_matches_serial(S, L):
    X = _data(L)
    res = S.f_red(synk.data(X))
    ref = S.serial(X)
    assert isinstance(res, list) and len(res) == len(MODES)
    for i in (I_AVG, I_SUM, I_PROD, I_MAX, I_MIN):
        assert res[i].dtype == ref[i].dtype == np.float32
        assert res[i].shape == ref[i].shape
        np.testing.assert_allclose(res[i], ref[i], rtol=2e-6, atol=1e-6, err_msg=f"mode {MODES[i]}")
        assert not np.isnan(res[i]).any()
    # gather concatenates the shards in rank order: exactly the serial result
    np.testing.assert_array_equal(res[I_GATHER], ref[I_GATHER])
    # scalars gathered: one entry per non-empty shard, in order
    counts = _check_counts(res[I_COUNTS], L, S.n)
    parts = _shards(X, counts)
    np.testing.assert_allclose(res[I_PARTIAL], [p.sum() for p in parts], rtol=2e-6)
    # mode None: the master's own (rank 0) result, not reduced
    # (when the master's shard is empty: the first non-empty shard's own result)
    assert res[I_NONE].dtype == np.float32 and res[I_NONE].shape == (3,)
    np.testing.assert_allclose(res[I_NONE], parts[0].sum(axis=0), rtol=2e-6)
    if L >= S.n and len(parts) > 1:
        assert not np.allclose(res[I_NONE], ref[I_SUM])


@pytest.mark.parametrize("L", [1, 2, 3, 5, 7])
def test_avg_is_true_mean_weighted_by_shard_length(S, L):
    # rows with very different values, so an unweighted mean of shard means is visibly wrong
    X = (np.arange(L, dtype=np.float32) ** 2)[:, None] * np.array([[1, -2, 3]], dtype=np.float32)
    res = S.f_red(synk.data(X))
    np.testing.assert_allclose(res[I_AVG], X.astype(np.float64).mean(axis=0), rtol=1e-6)
    assert not np.isnan(res[I_AVG]).any()
    counts = _check_counts(res[I_COUNTS], L, S.n)
    if len(set(counts.tolist())) > 1:
        unweighted = np.mean([p.mean(axis=0) for p in _shards(X, counts)], axis=0)
        assert not np.allclose(res[I_AVG], unweighted)


def test_one_row_over_all_ranks_no_nan(S):
    X = np.array([[1.5, -2.0, 4.0]], dtype=np.float32)
    res = S.f_red(synk.data(X))
    for i in (I_AVG, I_SUM, I_PROD, I_MAX, I_MIN):
        np.testing.assert_array_equal(res[i], X[0])
    np.testing.assert_array_equal(res[I_GATHER], 2 * X)
    np.testing.assert_array_equal(res[I_COUNTS], [1])


def test_mode_none_with_empty_master_shard(S):
    X = np.array([[1.5, -2.0, 4.0]], dtype=np.float32)      # 1 row: rank 0's shard is empty
    res = S.f_red(synk.data(X))
    out = res[I_NONE]
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == (3,)
    # the only non-empty shard's own result (there is no master result to return)
    np.testing.assert_array_equal(out, X[0])


def test_gather_preserves_row_order(S):
    X = np.arange(7 * 3, dtype=np.float32).reshape(7, 3)
    res = S.f_red(synk.data(X))
    np.testing.assert_array_equal(res[I_GATHER], 2 * X)
    assert res[I_GATHER].shape == (7, 3)


def test_numpy_inputs_equal_data_inputs(S):
    # varying lengths also exercise the re-use and growth of the internal staging buffers
    for L in (7, 3, 12, 1, 12, 30, 5):
        X = _data(L, seed=7)
        r_np = S.f_red(X)
        r_data = S.f_red(synk.data(X))
        for i, (u, v) in enumerate(zip(r_np, r_data)):
            np.testing.assert_array_equal(u, v, err_msg=f"L={L} output {i}")
        np.testing.assert_allclose(r_np[I_SUM], S.serial(X)[I_SUM], rtol=2e-6)
    # numpy and Data mixed; python lists are accepted too (same kind)
    A = np.arange(9, dtype=np.float32)
    B = np.linspace(0, 1, 9).astype(np.float32)
    expect = float(np.sum(A.astype(np.float64) * B))
    assert np.isclose(S.f7(A, synk.data(B)), expect, rtol=1e-6)
    assert np.isclose(S.f7(synk.data(A), B), expect, rtol=1e-6)
    assert np.isclose(S.f7(A.tolist(), B), expect, rtol=1e-6)


def test_inputs_by_name(S):
    X = _data(5)
    by_pos = S.f_red(X)
    by_name = S.f_red(x=X)
    for u, v in zip(by_pos, by_name):
        np.testing.assert_array_equal(u, v)
    A = np.arange(1, 8, dtype=np.float32)
    B = (A % 3).astype(np.float32)
    expect = float(np.sum(A * B))
    assert S.f7(a=synk.data(A), b=synk.data(B)) == pytest.approx(expect)
    assert S.f7(b=B, a=A) == pytest.approx(expect)
    assert S.f7(A, b=B) == pytest.approx(expect)
    Y = np.arange(3, dtype=np.float32)
    assert np.allclose(S.g_single(x=X, y=Y), S.g_serial(X, Y))


def test_return_list_vs_single_output(S):
    X = _data(6)
    Y = np.array([1, -1, 2], dtype=np.float32)
    r = S.g_single(synk.data(X), synk.data(Y))
    assert isinstance(r, np.ndarray) and r.ndim == 0
    assert np.allclose(r, S.g_serial(X, Y))
    rl = S.g_list(synk.data(X), synk.data(Y))
    assert isinstance(rl, list) and len(rl) == 1
    assert np.allclose(rl[0], r)
    # (var, mode) alone is a single output too; sum of per-rank means here
    rs = S.g_sum(X, Y)
    assert isinstance(rs, np.ndarray) and rs.ndim == 0
    assert S.g_single.output_modes == ["avg"] and S.g_sum.output_modes == ["sum"]
    assert S.f_red.output_modes == MODES
    # no outputs: an empty list
    assert S.f_upd(np.ones((2, 2), np.float32)) == []
    S.s.set_value(np.ones(2, dtype=np.float32))


def test_output_subset_order(S):
    X = _data(7)
    full = S.f_red(X)
    sub = S.f_red(X, output_subset=[I_MAX, I_AVG])
    assert isinstance(sub, list) and len(sub) == 2
    np.testing.assert_array_equal(sub[0], full[I_MAX])
    np.testing.assert_array_equal(sub[1], full[I_AVG])
    # a single-output function with output_subset still returns a list
    Y = np.ones(3, np.float32)
    assert isinstance(S.g_single(X, Y, output_subset=[0]), list)


@pytest.mark.parametrize("num_slices", [2, 3, 10])
def test_num_slices_matches_serial(S, num_slices):
    X = _data(11)
    ref = S.serial(X)
    idx = [I_AVG, I_SUM, I_PROD, I_MAX, I_MIN, I_GATHER]
    res = S.f_red(X, output_subset=idx, num_slices=num_slices)
    for j, i in enumerate(idx):
        np.testing.assert_allclose(res[j], ref[i], rtol=5e-6, atol=1e-6, err_msg=f"mode {MODES[i]}")


def test_empty_batch_matches_serial(S):
    A = np.zeros(0, dtype=np.float32)
    r = S.f7(synk.data(A), synk.data(A))
    assert float(r) == 0.0
    r = S.f7(A, A)
    assert float(r) == 0.0
    # and the function keeps working on non-empty data afterwards
    A = np.arange(5, dtype=np.float32)
    assert S.f7(A, A) == pytest.approx(float(np.sum(A * A)))


def test_updates_apply_locally_docs_example(S):
    """The docs' Theano shared variable example: s <- sum(x * s, axis=0)."""
    s_init = np.ones(2, dtype="float32")
    X = np.array([[1, 1], [2, 2], [3, 3], [4, 4]]).astype("float32")
    x_dat = synk.data(X)
    S.s.set_value(s_init)
    S.f_upd.as_theano(x_dat.data)                       # plain PyTensor, whole batch
    np.testing.assert_array_equal(S.s.get_value(), [10, 10])

    # the rows the master computes on (rank 0's shard)
    counts = _check_counts(S.f_red(np.zeros((4, 3), np.float32))[I_COUNTS], 4, S.n)
    m = int(counts[0])
    S.s.set_value(s_init)
    assert S.f_upd(x_dat) == []
    local = X[:m].sum(axis=0)
    np.testing.assert_array_equal(S.s.get_value(), local)  # n=2: [3, 3] as in the docs
    if S.n == 2:
        np.testing.assert_array_equal(S.s.get_value(), [3, 3])
    # the next call reads the updated value: s <- sum(x * s) again
    S.f_upd(x_dat)
    np.testing.assert_array_equal(S.s.get_value(), local * local)

    # the same as running serial PyTensor (as_theano) on the master's shard only
    S.s.set_value(s_init)
    S.f_upd.as_theano(X[:m])
    np.testing.assert_array_equal(S.s.get_value(), local)
    S.s.set_value(s_init)


@pytest.mark.parametrize("L,num_slices", [(7, 1), (1, 1), (5, 2), (2, 1)])
def test_share_update_averages_to_the_batch_mean(S, L, num_slices):
    """Update mode ``'share'``: each rank's value is its mean scaled by ``n * rows / L``
    (zeros without rows), so that ``synk.all_reduce(op='avg')`` gives the mean over the
    whole batch however the rows split."""
    X = np.random.default_rng(L).standard_normal((L, 3))
    b = [r * L // S.n for r in range(S.n + 1)]        # the documented split: rows r*L//n
    S.f_share(X, num_slices=num_slices)
    per_rank = synk.gather(S.sh, nd_up=1)
    for r in range(S.n):
        rows = X[b[r]:b[r + 1]]
        want = rows.mean(axis=0) * S.n * len(rows) / L if len(rows) else np.zeros(3)
        np.testing.assert_allclose(per_rank[r], want, rtol=1e-12, atol=1e-15, err_msg=f"rank {r}")
    synk.all_reduce(S.sh, op="avg")
    np.testing.assert_allclose(S.sh.get_value(), X.mean(axis=0), rtol=1e-12)


def test_scalar_broadcast_input(S):
    """A 0-d broadcast input (numpy scalar, python float or 0-d Data) reaches every rank."""
    A = np.arange(1, 9, dtype=np.float32)
    assert S.f8(A, np.float32(2.5)) == pytest.approx(float(A.sum()) * 2.5)
    assert S.f8(A, np.float32(-1)) == pytest.approx(-float(A.sum()))
    assert S.f8(A, 0.5) == pytest.approx(float(A.sum()) * 0.5)
    c = synk.data(np.float32(3))
    assert S.f8(synk.data(A), c) == pytest.approx(float(A.sum()) * 3)
    c.set_value(np.float32(4))
    assert S.f8(A, c) == pytest.approx(float(A.sum()) * 4)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(L=st.integers(1, 25), seed=st.integers(0, 2 ** 16))
def test_random_lengths_property(S, L, seed):
    rng = np.random.default_rng(seed)
    X = rng.integers(-8, 9, size=(L, 2)).astype(np.float32) / 4   # exactly representable
    res = S.f_red(X)
    X64 = X.astype(np.float64)
    np.testing.assert_allclose(res[I_AVG], X64.mean(axis=0), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(res[I_SUM], X64.sum(axis=0))
    np.testing.assert_array_equal(res[I_MAX], X.max(axis=0))
    np.testing.assert_array_equal(res[I_MIN], X.min(axis=0))
    np.testing.assert_array_equal(res[I_GATHER], 2 * X)
    _check_counts(res[I_COUNTS], L, S.n)
