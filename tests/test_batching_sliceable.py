"""Sliceable shareds: ``synk.scatter`` gives each rank its floor split of the rows;
``batch_s`` of every kind (one selector for every rank, or one per rank), with num_slices
and without, on a function of the sliceable shareds only (f4) and on one that also scatters
an input (f3: its rows must agree with each rank's selected rows), checked against numpy on
each rank's rows."""
import numpy as np
import pytest

import synkhronos as synk
from batching_testutil import (D, CallCounter, S_data, check_f3, check_f4, ints, scatter_S, session, set_local_S,
                               split)


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"n{n}")
def sess(request):
    yield from session(request.param)


# ------------------------------------------------------------------------------------------
# sliceable shareds: synk.scatter + batch_s, f4 (shareds only) and f3 (with scattered inputs)


def test_scatter_gives_floor_split(sess):
    s = sess
    rng = np.random.default_rng(3)
    for L in (0, 1, 2, 5, 7, 11):
        S_all, t_all = S_data(rng, L)
        S_list, t_list = scatter_S(s, S_all, t_all)
        for r in range(s.n):
            np.testing.assert_array_equal(synk.get_value(r, s.S), S_list[r])
            np.testing.assert_array_equal(synk.get_value(r, s.t), t_list[r])


def _batch_s_cases(n, lens):
    """Valid batch_s values for per-rank local lengths ``lens`` (every rank non-empty)."""
    m = min(lens)
    cases = [
        ("slice_all", slice(0, m)),
        ("slice_mid", slice(m // 2, m)),
        ("list", [m - 1, 0, m - 1]),
        ("tuple", tuple(range(m))),
        ("arr_u8", np.array([0, m - 1], dtype=np.uint8)),
        ("arr_i16_rep", np.full(5, m - 1, dtype=np.int16)),
        ("per_rank_slices", [slice(0, L) for L in lens]),
        ("per_rank_slices_tail", [slice(L - 1, L) for L in lens]),
        ("per_rank_lists", [list(range(L - 1, -1, -1)) for L in lens]),
        ("per_rank_arrays", [np.array([L - 1] * (r + 1), dtype=np.uint32) for r, L in enumerate(lens)]),
    ]
    if n > 1:
        cases.append(("per_rank_some_empty", [[] if r % 2 else [0, L - 1] for r, L in enumerate(lens)]))
    return cases


def test_f4_batch_s_every_kind(sess):
    s = sess
    rng = np.random.default_rng(21)
    L = 4 * s.n + 1                       # every rank >= 4 rows, unequal when n > 1
    S_all, t_all = S_data(rng, L)
    S_list, t_list = scatter_S(s, S_all, t_all)
    lens = [len(x) for x in S_list]
    for name, bs in _batch_s_cases(s.n, lens):
        for num_slices in (1, 2, 3, 6):
            acc0 = [ints(rng, D) for _ in range(s.n)]
            for r in range(s.n):
                synk.set_value(r, s.acc, acc0[r])
            out = s.f4(batch_s=bs, num_slices=num_slices)
            try:
                check_f4(s, out, S_list, t_list, bs, num_slices, acc0)
            except AssertionError as e:
                raise AssertionError(f"batch_s case {name}, num_slices={num_slices}: {e}") from None


def test_f4_num_slices_without_batch_s(sess):
    """Slicing with no batch_s covers each rank's whole local shareds."""
    s = sess
    rng = np.random.default_rng(22)
    S_list = [ints(rng, (3 + 2 * r, D)) for r in range(s.n)]
    t_list = [ints(rng, 3 + 2 * r) for r in range(s.n)]
    set_local_S(s, S_list, t_list)
    for num_slices in (2, 3, 5, 40):
        acc0 = [np.zeros(D)] * s.n
        synk.broadcast(s.acc, np.zeros(D))
        out = s.f4(num_slices=num_slices)
        check_f4(s, out, S_list, t_list, None, num_slices, acc0)


def test_f4_no_batch_s_equal_lengths(sess):
    s = sess
    rng = np.random.default_rng(23)
    S_all, t_all = S_data(rng, 4 * s.n)           # equal local lengths
    S_list, t_list = scatter_S(s, S_all, t_all)
    out = s.f4()
    check_f4(s, out, S_list, t_list, None, 1)


def test_f4_no_batch_s_avg_weighted_by_local_length(sess, request):
    """Without batch_s each rank's share is its whole local shareds: avg is the true mean
    over all ranks' rows, as it is with num_slices > 1."""
    s = sess
    S_list = [np.zeros((1 + 2 * r, D)) for r in range(s.n)]
    t_list = [np.zeros(1 + 2 * r) for r in range(s.n)]
    t_list[-1][-1] = -1.0                           # one row with v = 2, all others 0
    set_local_S(s, S_list, t_list)
    total = sum(len(x) for x in t_list)
    sliced = s.f4(num_slices=2)
    assert sliced[1] == pytest.approx(2.0 / total, abs=1e-15)       # weighted by length
    out = s.f4()
    check_f4(s, out, S_list, t_list, None, 1)                         # equal weights: wrong


def test_f4_no_batch_s_rank_without_rows(sess, request):
    """A rank whose local shareds are empty has nothing to compute: no NaN, no -inf/inf."""
    s = sess
    rng = np.random.default_rng(24)
    S_list = [ints(rng, (0 if r == 0 and s.n > 1 else 3, D)) for r in range(s.n)]
    t_list = [ints(rng, len(x)) for x in S_list]
    set_local_S(s, S_list, t_list)
    acc0 = [np.zeros(D)] * s.n
    synk.broadcast(s.acc, np.zeros(D))
    out = s.f4()
    for o in out:
        assert o is None or np.all(np.isfinite(o))
    check_f4(s, out, S_list, t_list, None, 1, acc0)


def test_f3_givens_scattered_and_sliceable(sess):
    """givens={u: S}: S is sliced like t; z's shards must match each rank's selected rows."""
    s = sess
    rng = np.random.default_rng(31)
    L = 3 * s.n + 2
    S_all, t_all = S_data(rng, L)
    S_list, t_list = scatter_S(s, S_all, t_all)
    lens = [len(x) for x in S_list]
    z = ints(rng, L)
    # no batch, no batch_s: shards of z and S agree (same floor split)
    for num_slices in (1, 2, 4):
        out = s.f3(z, num_slices=num_slices)
        check_f3(s, out, z, np.arange(L), S_list, t_list, None, num_slices)
    # batch on z + per-rank batch_s selecting as many rows as each rank's z shard
    zlong = ints(rng, 40)
    for zrows in ([5, 0, 33, 7, 7, 12, 39, 1, 2][:max(1, s.n + 1)], list(range(L - 1))):
        zrows = np.array(zrows)
        b = split(len(zrows), s.n)
        cnt = [b[r + 1] - b[r] for r in range(s.n)]
        assert all(c <= Lr for c, Lr in zip(cnt, lens))
        for bs in ([list(range(Lr - c, Lr)) for c, Lr in zip(cnt, lens)],
                   [slice(0, c) for c in cnt],
                   [np.array(rng.integers(0, Lr, c), dtype=np.int8) for c, Lr in zip(cnt, lens)]):
            for num_slices in (1, 3):
                out = s.f3(zlong, batch=zrows.astype(np.uint16), batch_s=bs, num_slices=num_slices)
                check_f3(s, out, zlong, zrows, S_list, t_list, bs, num_slices)
        # a contiguous slice batch of z, batch_s as slices
        out = s.f3(zlong, batch=slice(10, 10 + len(zrows)), batch_s=[slice(0, c) for c in cnt], num_slices=2)
        check_f3(s, out, zlong, np.arange(10, 10 + len(zrows)), S_list, t_list,
                 [slice(0, c) for c in cnt], 2)


def test_f3_length_mismatch_rejected_in_master(sess, monkeypatch):
    s = sess
    rng = np.random.default_rng(32)
    L = 2 * s.n + 1
    S_all, t_all = S_data(rng, L)
    S_list, t_list = scatter_S(s, S_all, t_all)
    cc = CallCounter()
    with pytest.raises(ValueError, match="agree"):
        s.f3(ints(rng, L + s.n))                   # more z rows than shared rows
    with pytest.raises(ValueError, match="agree"):
        s.f3(ints(rng, 50), batch=L - 1)
    with pytest.raises(ValueError, match="agree"):
        s.f3(ints(rng, L), batch_s=slice(0, 1), num_slices=2)
    assert cc.n_call == 0
    z = ints(rng, L)
    out = s.f3(z, num_slices=2)
    check_f3(s, out, z, np.arange(L), S_list, t_list, None, 2)
    assert cc.n_call == 1
