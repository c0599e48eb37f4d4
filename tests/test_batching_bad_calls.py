"""Bad calls: a table of malformed ``batch``, ``batch_s``, ``num_slices`` and
``output_subset`` arguments, and of inputs that disagree with them, each rejected in the
master (TypeError, ValueError or IndexError) before any worker runs and without changing any
state; a good call then works, twice, and after all the bad calls in a row."""
import numpy as np
import pytest

import synkhronos as synk
from batching_testutil import (D, CallCounter, S_data, check_f1, check_f2, check_f3, check_f4, ints, scatter_S,
                               session, set_f2_state, split)


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"n{n}")
def sess(request):
    yield from session(request.param)


# ------------------------------------------------------------------------------------------
# Bad calls: each rejected in the master before any worker runs, then a good call works


def _bad_calls(s):
    """(id, target, args, kwargs, exception) for session ``s`` (which knows n)."""
    n = s.n
    X, Y, W = s.X_d, s.Y_d, s.W_d
    f1 = (X, Y, W)
    L = 2 * n + 1
    lens = split(L, n)
    lens = [lens[r + 1] - lens[r] for r in range(n)]
    m = min(lens)
    B = []

    def add(i, target, args, kw, exc):
        B.append((i, target, args, kw, exc))
    # ---- batch: types
    add("batch_float", "f1", f1, dict(batch=2.5), TypeError)
    add("batch_str", "f1", f1, dict(batch="3"), TypeError)
    add("batch_bool", "f1", f1, dict(batch=True), TypeError)
    add("batch_set", "f1", f1, dict(batch={1, 2}), TypeError)
    add("batch_dict", "f1", f1, dict(batch={0: 1}), TypeError)
    add("batch_float_list", "f1", f1, dict(batch=[0.0, 1.0]), TypeError)
    add("batch_float_array", "f1", f1, dict(batch=np.array([0.0, 1.0])), TypeError)
    add("batch_bool_list", "f1", f1, dict(batch=[True, False]), TypeError)
    add("batch_bool_array", "f1", f1, dict(batch=np.ones(10, bool)), TypeError)
    add("batch_str_list", "f1", f1, dict(batch=["a"]), TypeError)
    add("batch_2d_array", "f1", f1, dict(batch=np.array([[0, 1]])), ValueError)
    add("batch_2d_list", "f1", f1, dict(batch=[[0], [1]]), ValueError)
    add("batch_2d_uint", "f1", f1, dict(batch=np.zeros((2, 2), np.uint8)), ValueError)
    # ---- batch: ranges
    add("batch_int_neg", "f1", f1, dict(batch=-1), IndexError)
    add("batch_int_past_end", "f1", f1, dict(batch=11), IndexError)
    add("batch_slice_past_end", "f1", f1, dict(batch=slice(0, 11)), IndexError)
    add("batch_slice_start_past_end", "f1", f1, dict(batch=slice(10, 12)), IndexError)
    add("batch_slice_neg", "f1", f1, dict(batch=slice(-1, 4)), IndexError)
    add("batch_slice_reversed", "f1", f1, dict(batch=slice(5, 3)), IndexError)
    add("batch_index_eq_len", "f1", f1, dict(batch=[0, 10]), IndexError)
    add("batch_index_eq_len_u8", "f1", f1, dict(batch=np.array([0, 10], np.uint8)), IndexError)
    add("batch_index_neg", "f1", f1, dict(batch=[0, -1]), IndexError)
    add("batch_index_neg_i8", "f1", f1, dict(batch=np.array([3, -128], np.int8)), IndexError)
    # ---- batch: slices with steps or without int bounds
    add("batch_slice_step1", "f1", f1, dict(batch=slice(0, 4, 1)), ValueError)
    add("batch_slice_step2", "f1", f1, dict(batch=slice(0, 4, 2)), ValueError)
    add("batch_slice_no_start", "f1", f1, dict(batch=slice(None, 4)), TypeError)
    add("batch_slice_no_stop", "f1", f1, dict(batch=slice(2, None)), TypeError)
    add("batch_slice_float", "f1", f1, dict(batch=slice(1.0, 4)), TypeError)
    add("batch_slice_full", "f1", f1, dict(batch=slice(None)), TypeError)
    # ---- inputs inconsistent with the batch
    add("lengths_differ", "f1", (X, np.zeros(9), W), {}, ValueError)
    add("minibatch_short", "f1", f1[:1] + ("mb3",) + f1[2:], dict(batch=[0, 1, 2, 3]), ValueError)
    add("minibatch_short_slice", "f1", f1[:1] + ("mb3",) + f1[2:], dict(batch=slice(2, 6)), ValueError)
    # ---- batch_s where there is nothing sliceable; batch where nothing is scattered
    add("batch_s_no_sliceable", "f1", f1, dict(batch_s=[0, 1]), ValueError)
    add("batch_s_no_sliceable_f2", "f2", (s.X,), dict(batch_s=slice(0, 1)), ValueError)
    add("batch_no_scattered", "f4", (), dict(batch=[0]), ValueError)
    # ---- num_slices
    for i, ns in enumerate([0, -1, 1.5, True, False, "2", None, np.float64(2.0), [2]]):
        add(f"num_slices_{i}_{ns!r}", "f1", f1, dict(num_slices=ns), ValueError)
    add("num_slices_zero_f2", "f2", (s.X,), dict(num_slices=0), ValueError)
    add("num_slices_zero_f4", "f4", (), dict(num_slices=0), ValueError)
    add("num_slices_bool_f4", "f4", (), dict(num_slices=True), ValueError)
    # ---- output_subset
    add("subset_int", "f1", f1, dict(output_subset=0), TypeError)
    add("subset_str", "f1", f1, dict(output_subset="01"), TypeError)
    add("subset_float", "f1", f1, dict(output_subset=[0.0]), TypeError)
    add("subset_bool", "f1", f1, dict(output_subset=[True]), TypeError)
    add("subset_range_hi", "f1", f1, dict(output_subset=[7]), IndexError)
    add("subset_range_neg", "f1", f1, dict(output_subset=[0, -1]), IndexError)
    add("subset_repeat", "f1", f1, dict(output_subset=[1, 0, 1]), ValueError)
    add("subset_repeat_f2", "f2", (s.X,), dict(output_subset=[0, 0]), ValueError)
    add("subset_range_f4", "f4", (), dict(output_subset=[6]), IndexError)
    # ---- batch_s
    add("bs_int", "f4", (), dict(batch_s=1), TypeError)
    add("bs_str", "f4", (), dict(batch_s="0"), TypeError)
    add("bs_float_list", "f4", (), dict(batch_s=[0.5]), TypeError)
    add("bs_bool_arr", "f4", (), dict(batch_s=np.array([True])), TypeError)
    add("bs_2d", "f4", (), dict(batch_s=np.zeros((1, 2), int)), ValueError)
    add("bs_neg", "f4", (), dict(batch_s=[0, -1]), IndexError)
    add("bs_slice_step", "f4", (), dict(batch_s=slice(0, 1, 1)), ValueError)
    add("bs_slice_none", "f4", (), dict(batch_s=slice(None, 1)), TypeError)
    add("bs_slice_neg", "f4", (), dict(batch_s=slice(-1, 1)), IndexError)
    add("bs_slice_past_min_len", "f4", (), dict(batch_s=slice(0, m + 1)), IndexError)
    add("bs_index_eq_min_len", "f4", (), dict(batch_s=[m]), IndexError)
    add("bs_index_eq_min_len_u16", "f4", (), dict(batch_s=np.array([0, m], np.uint16)), IndexError)
    add("bs_per_rank_too_many", "f4", (), dict(batch_s=[slice(0, 1)] * (n + 1)), ValueError)
    add("bs_per_rank_lists_too_many", "f4", (), dict(batch_s=[[0]] * (n + 1)), ValueError)
    if n > 1:
        add("bs_per_rank_too_few", "f4", (), dict(batch_s=[slice(0, 1)] * (n - 1)), ValueError)
        add("bs_per_rank_mixed", "f4", (), dict(batch_s=[slice(0, 1)] + [[0]] * (n - 1)), TypeError)
    add("bs_per_rank_last_eq_len", "f4", (),
        dict(batch_s=[[0] for _ in range(n - 1)] + [[lens[-1]]]), IndexError)
    add("bs_per_rank_last_slice_past", "f4", (),
        dict(batch_s=[slice(0, 1) for _ in range(n - 1)] + [slice(0, lens[-1] + 1)]), IndexError)
    add("bs_per_rank_neg", "f4", (), dict(batch_s=[[0]] * (n - 1) + [[-2]]), IndexError)
    add("bs_per_rank_step", "f4", (), dict(batch_s=[slice(0, 1, 1)] * n), ValueError)
    add("bs_per_rank_float_arr", "f4", (), dict(batch_s=[np.zeros(1)] * n), TypeError)
    add("bs_f3_out_of_range", "f3", ("z",), dict(batch_s=slice(0, m + 1)), IndexError)
    # ---- scattered + sliceable lengths must agree per rank
    add("f3_len_mismatch", "f3", ("zlong",), {}, ValueError)
    add("f3_batch_mismatch", "f3", ("zlong",), dict(batch=L - 1), ValueError)
    add("f3_bs_mismatch", "f3", ("z",), dict(batch_s=[slice(0, 1)] * n), ValueError)
    return B


# Test ids: the table's entries as built for n=3 (a superset: n=1 lacks the per-rank mix-ups).
_IDS = [b[0] for b in _bad_calls(type("Ids", (), dict(n=3, X_d=None, Y_d=None, W_d=None, X=None))())]


def _prepare_bad_call_state(s, rng):
    L = 2 * s.n + 1
    S_all, t_all = S_data(rng, L)
    S_list, t_list = scatter_S(s, S_all, t_all)
    z = ints(rng, L)
    return L, S_list, t_list, z


def _good_call(s, target, rng, L, S_list, t_list, z):
    """A valid call of ``target`` and the check of its results."""
    if target == "f1":
        batch = [9, 4, 4, 0, 7, 2]
        out = s.f1(s.X_d, s.Y_d, s.W_d, batch=batch, num_slices=2)
        check_f1(s, out, s.X, s.Y, s.W, batch, 2)
    elif target == "f2":
        orig = set_f2_state(s, rng)
        X = ints(rng, (7, D))
        out = s.f2(X, batch=slice(1, 6), num_slices=2)
        check_f2(s, out, X, np.arange(1, 6), 2, orig)
    elif target == "f3":
        out = s.f3(z, num_slices=2)
        check_f3(s, out, z, np.arange(L), S_list, t_list, None, 2)
    elif target == "f4":
        acc0 = [ints(rng, D) for _ in range(s.n)]
        for r in range(s.n):
            synk.set_value(r, s.acc, acc0[r])
        bs = [slice(0, len(S_list[r])) for r in range(s.n)]
        out = s.f4(batch_s=bs, num_slices=2)
        check_f4(s, out, S_list, t_list, bs, 2, acc0)
    else:  # pragma: no cover
        raise AssertionError(target)


@pytest.mark.parametrize("idx", range(len(_IDS)), ids=_IDS)
def test_bad_call_then_good_call(sess, idx, monkeypatch):
    s = sess
    table = _bad_calls(s)
    ids = [b[0] for b in table]
    if _IDS[idx] not in ids:
        pytest.skip(f"{_IDS[idx]} does not apply with n={s.n}")
    name, target, args, kw, exc = table[ids.index(_IDS[idx])]
    rng = np.random.default_rng(idx)
    L, S_list, t_list, z = _prepare_bad_call_state(s, rng)
    subst = {"z": z, "zlong": ints(rng, L + s.n), "mb3": synk.data(np.zeros(3), minibatch=True)}
    args = tuple(subst[a] if isinstance(a, str) else a for a in args)
    fn = getattr(s, target)
    # f2's update state must not change on a rejected call
    before = synk.gather([s.g, s.a, s.m, s.c]) if target == "f2" else None
    acc_before = synk.gather(s.acc) if target == "f4" else None
    cc = CallCounter()
    with pytest.raises(exc):
        fn(*args, **kw)
    assert cc.n_call == 0, f"{name}: a call command reached the workers"
    if before is not None:
        for b, a in zip(before, synk.gather([s.g, s.a, s.m, s.c])):
            np.testing.assert_array_equal(b, a)
    if acc_before is not None:
        np.testing.assert_array_equal(acc_before, synk.gather(s.acc))
    _good_call(s, target, rng, L, S_list, t_list, z)
    assert cc.n_call == 1
    # and once more (a rejected call leaves nothing half-done behind)
    _good_call(s, target, rng, L, S_list, t_list, z)


def test_many_bad_calls_in_a_row_then_good(sess):
    s = sess
    rng = np.random.default_rng(99)
    L, S_list, t_list, z = _prepare_bad_call_state(s, rng)
    mb3 = synk.data(np.zeros(3), minibatch=True)
    subst = {"z": z, "zlong": ints(rng, L + s.n), "mb3": mb3}
    for name, target, args, kw, exc in _bad_calls(s):
        args = tuple(subst[a] if isinstance(a, str) else a for a in args)
        with pytest.raises(exc):
            getattr(s, target)(*args, **kw)
    for target in ("f1", "f2", "f3", "f4"):
        _good_call(s, target, rng, L, S_list, t_list, z)
