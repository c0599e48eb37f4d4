"""Batches, slices and selectors of synkhronos functions, checked against serial PyTensor:
batch selectors of every kind with num_slices (f1), output_subset, updates under slicing
(f2), a scalar broadcast input, and regressions.  Sliceable shareds (``batch_s``) are in
``test_batching_sliceable.py``, calls rejected in the master in
``test_batching_bad_calls.py``; the session, its functions and the serial references in
``batching_testutil.py``.

Semantics under test (see the user guide, "Function Batches and Slices"): rank r computes
rows ``[r*N//n, (r+1)*N//n)`` of the N selected rows; ``num_slices`` splits each rank's
share into at most that many non-empty pieces the same way; outputs accumulate over pieces
by mode (avg weighted by piece size, gather concatenates, None keeps the last piece) and
are reduced over ranks once (avg weighted by shard length, None: the master's own result);
updates are computed from the original values in every piece, accumulated by their mode
and applied once, locally in every rank."""
import numpy as np
import pytensor
import pytest

import synkhronos as synk
from batching_testutil import (D, INT_DTYPES, CallCounter, S_data, check_f1, check_f2, ints, scatter_S,
                               selected_rows, session, set_f2_state)


@pytest.fixture(scope="module", params=[1, 2, 3], ids=lambda n: f"n{n}")
def sess(request):
    yield from session(request.param)


# ------------------------------------------------------------------------------------------
# f1: batch selectors of every kind, with num_slices, against serial PyTensor

SELECTORS = [
    ("none", None),
    ("int", 7),
    ("int_full", 10),
    ("int_one", 1),
    ("np_int", np.int32(6)),
    ("slice", slice(2, 9)),
    ("slice_full", slice(0, 10)),
    ("slice_one", slice(9, 10)),
    ("slice_npint", slice(np.int64(1), np.uint8(8))),
    ("list", [9, 0, 3, 3, 7]),
    ("tuple", (4, 8, 1, 0, 2, 6, 5)),
    ("list_one", [5]),
    ("list_repeat", [2] * 6),
    ("list_all_rev", list(range(9, -1, -1))),
] + [(f"arr_{np.dtype(dt).name}", np.array([8, 1, 1, 9, 0, 4, 6], dtype=dt)) for dt in INT_DTYPES]


@pytest.mark.parametrize("name,batch", SELECTORS, ids=[n for n, _ in SELECTORS])
def test_f1_selectors_match_serial(sess, name, batch):
    s = sess
    rows = selected_rows(batch, s.N)
    for num_slices in (1, 2, 3, 5):
        out = s.f1(s.X_d, s.Y_d, s.W_d, batch=batch, num_slices=num_slices)
        check_f1(s, out, s.X, s.Y, s.W, rows, num_slices)
    # numpy arrays instead of Data give the same results
    out = s.f1(s.X, s.Y, s.W, batch=batch, num_slices=2)
    check_f1(s, out, s.X, s.Y, s.W, rows, 2)


def test_f1_index_array_not_modified_and_all_int_dtypes_agree(sess):
    s = sess
    idx = [7, 3, 3, 0, 9, 2]
    ref = s.f1(s.X_d, s.Y_d, s.W_d, batch=idx, num_slices=2)
    for dt in INT_DTYPES:
        arr = np.array(idx, dtype=dt)
        keep = arr.copy()
        out = s.f1(s.X_d, s.Y_d, s.W_d, batch=arr, num_slices=2)
        np.testing.assert_array_equal(arr, keep)
        assert arr.dtype == dt
        for o, e in zip(out, ref):
            np.testing.assert_array_equal(o, e)
    # a non-contiguous index view works too
    arr = np.array([0, 7, 1, 3, 2, 3, 3, 0, 4, 9, 5, 2], dtype=np.int16)[::2]
    out = s.f1(s.X_d, s.Y_d, s.W_d, batch=arr)
    check_f1(s, out, s.X, s.Y, s.W, arr, 1)


@pytest.mark.parametrize("batch", [None, 6, slice(3, 9), [9, 2, 2, 5, 0], np.array([1, 8, 4], np.uint16)],
                         ids=["none", "int", "slice", "list", "uint16"])
def test_f1_minibatch_rows_by_position(sess, batch):
    """A minibatch Data holds the already-selected rows: row j pairs with the j-th selected row."""
    s = sess
    rows = selected_rows(batch, s.N)
    k = len(rows)
    ymb = (np.arange(k, dtype=np.float64) * 10 - 7)
    for extra in ((0, 3) if batch is not None else (0,)):      # without batch: equal lengths
        vals = np.concatenate([ymb, np.full(extra, 1000.0)])
        s.Ymb_d.set_value(vals)
        for num_slices in (1, 2, 4):
            out = s.f1(s.X_d, s.Ymb_d, s.W_d, batch=batch, num_slices=num_slices)
            check_f1(s, out, s.X, s.Y, s.W, rows, num_slices, ymb=vals)


def test_f1_minibatch_built_by_build_inputs(sess):
    s = sess
    rows = np.array([3, 1, 4, 1, 5, 9])
    ymb = np.arange(len(rows), dtype=np.float64)
    xd, yd, wd = s.f1.build_inputs(s.X, ymb, s.W, minibatch=[False, True, False])
    assert yd.minibatch and not xd.minibatch
    out = s.f1(xd, yd, wd, batch=rows, num_slices=3)
    check_f1(s, out, s.X, s.Y, s.W, rows, 3, ymb=ymb)


@pytest.mark.parametrize("num_slices", [1, 2, 3, 4, 5, 7, 50, np.int64(3), np.uint8(2)])
def test_num_slices_more_than_rows(sess, num_slices):
    """A share smaller than num_slices runs fewer, non-empty pieces (no NaN, no empty call)."""
    s = sess
    for batch in (3, [8, 0, 5], slice(4, 6), 1):
        rows = selected_rows(batch, s.N)
        out = s.f1(s.X_d, s.Y_d, s.W_d, batch=batch, num_slices=num_slices)
        check_f1(s, out, s.X, s.Y, s.W, rows, int(num_slices))


def test_avg_is_weighted_by_shard_length(sess):
    """5 rows over 2 or 3 ranks give unequal shards: avg is still the true mean."""
    s = sess
    X = np.zeros((5, D))
    Y = np.array([0.0, 0.0, 0.0, 0.0, 10.0])
    out = s.f1(X, Y, np.zeros(D))
    assert out[1] == pytest.approx(2.0, abs=1e-15)
    out = s.f1(X, Y, np.zeros(D), num_slices=2)
    assert out[1] == pytest.approx(2.0, abs=1e-15)


# ------------------------------------------------------------------------------------------
# output_subset


def test_output_subset_order_and_no_recompile(sess, monkeypatch):
    s = sess
    compiled = []
    orig_fn = pytensor.function

    def counting(*a, **k):
        compiled.append(a)
        return orig_fn(*a, **k)
    monkeypatch.setattr(pytensor, "function", counting)
    batch, rows = [6, 2, 9, 0, 1], [6, 2, 9, 0, 1]
    full = s.f1(s.X_d, s.Y_d, s.W_d, batch=batch, num_slices=2)
    check_f1(s, full, s.X, s.Y, s.W, rows, 2)
    for subset in ([4, 0, 2], [5], [6, 5, 4, 3, 2, 1, 0], [1], (3, 0), [np.int64(2), 0]):
        out = s.f1(s.X_d, s.Y_d, s.W_d, batch=batch, num_slices=2, output_subset=subset)
        assert isinstance(out, list) and len(out) == len(subset)
        for o, i in zip(out, subset):
            np.testing.assert_array_equal(o, full[i])
    assert s.f1(s.X_d, s.Y_d, s.W_d, batch=batch, output_subset=[]) == []
    # back to all outputs after a subset
    again = s.f1(s.X_d, s.Y_d, s.W_d, batch=batch, num_slices=2, output_subset=None)
    assert len(again) == 7
    for o, e in zip(again, full):
        np.testing.assert_array_equal(o, e)
    assert compiled == []


def test_output_subset_with_updates_still_updates(sess):
    """Outputs left out of the subset are not returned, but updates still apply."""
    s = sess
    rng = np.random.default_rng(5)
    X = ints(rng, (8, D))
    for subset in ([1], [1, 0], []):
        orig = set_f2_state(s, rng)
        out = s.f2(X, num_slices=3, output_subset=subset)
        assert len(out) == len(subset)
        check_f2(s, out, X, np.arange(8), 3, orig, subset=subset)


# ------------------------------------------------------------------------------------------
# f2: updates under slicing


@pytest.mark.parametrize("batch", [None, 7, slice(1, 9), [9, 9, 0, 4, 2, 7, 1, 3], np.arange(10, dtype=np.int8)[::-1],
                                   [3]], ids=["none", "int", "slice", "list", "int8_rev", "one"])
def test_updates_accumulate_from_original_values(sess, batch):
    s = sess
    rng = np.random.default_rng(11)
    X = ints(rng, (10, D))
    rows = selected_rows(batch, 10)
    for num_slices in (1, 2, 3, 4, 9):
        orig = set_f2_state(s, rng)
        out = s.f2(X, batch=batch, num_slices=num_slices)
        check_f2(s, out, X, rows, num_slices, orig)


def test_updates_applied_once_not_per_slice(sess):
    """c has update c + 1 (mode None): one call gives c0 + 1 whatever num_slices is, and
    every slice reads c0 (the gathered output c + x[:, 0])."""
    s = sess
    X = np.zeros((12, D))
    X[:, 0] = np.arange(12)
    synk.broadcast(s.c, np.array([100.0]))
    out = s.f2(X, num_slices=4)
    np.testing.assert_array_equal(out[1], 100.0 + np.arange(12))
    np.testing.assert_array_equal(synk.gather(s.c), np.full((s.n, 1), 101.0))
    out = s.f2(X, num_slices=6)
    np.testing.assert_array_equal(out[1], 101.0 + np.arange(12))
    np.testing.assert_array_equal(synk.gather(s.c), np.full((s.n, 1), 102.0))
    for r in range(s.n):
        assert synk.get_value(r, s.c) == 102.0

# ------------------------------------------------------------------------------------------
# Scalar broadcast inputs with batch and slices


def test_scalar_bcast_input_reaches_workers(sess):
    """A 0-d (scalar) broadcast input, as numpy scalar or as synk.data, is seen by every rank
    (regression: a 0-d Data once never got a shared-memory segment, fixed in data.py)."""
    s = sess
    x = np.arange(1.0, 2.0 * s.n + 2)
    for h in (np.float64(3.0), synk.data(np.float64(5.0))):
        for batch in (None, [0, 2, 1, 2 * s.n]):
            rows = selected_rows(batch, len(x))
            out = s.f5(x, h, batch=batch, num_slices=2)
            np.testing.assert_array_equal(out[0], x[rows] * float(np.asarray(h)))


# ------------------------------------------------------------------------------------------
# Regressions: bugs found while writing these tests, now fixed

def test_none_output_when_master_share_empty(sess, request):
    """With 1 selected row and n >= 2 the master has no rows: the mode-None output should
    still be a result (the first rank with rows: its last piece), not None."""
    s = sess
    for batch, num_slices in (([7], 1), (1, 3), (slice(4, 5), 2)):
        rows = selected_rows(batch, s.N)
        out = s.f1(s.X_d, s.Y_d, s.W_d, batch=batch, num_slices=num_slices)
        assert out[5] is not None and np.asarray(out[5]).dtype == np.float64
        np.testing.assert_array_equal(out[5], s.X[rows].sum(axis=0))


def test_uint64_index_past_int64_rejected_in_master(sess, monkeypatch):
    s = sess
    cc = CallCounter()
    for bad in (np.array([2 ** 64 - 1], np.uint64), np.array([0, 2 ** 63 + 5], np.uint64)):
        with pytest.raises(IndexError):
            s.f1(s.X_d, s.Y_d, s.W_d, batch=bad)
    assert cc.n_call == 0


def test_uint64_batch_s_past_int64_rejected_in_master(sess, monkeypatch):
    s = sess
    rng = np.random.default_rng(41)
    scatter_S(s, *S_data(rng, 2 * s.n))
    cc = CallCounter()
    with pytest.raises(IndexError):
        s.f4(batch_s=np.array([2 ** 64 - 1], np.uint64))
    assert cc.n_call == 0


def test_batch_s_selecting_nothing(sess, monkeypatch):
    """Either a clear error in the master, or serial PyTensor's result on no rows (as f1
    gives for batch=[]): never an IndexError from inside the reduction."""
    s = sess
    rng = np.random.default_rng(42)
    scatter_S(s, *S_data(rng, 2 * s.n))
    for bs in ([], slice(1, 1), [[] for _ in range(s.n)]):
        cc = CallCounter()
        try:
            out = s.f4(batch_s=bs)
        except (ValueError, IndexError) as e:
            assert cc.n_call == 0, f"batch_s={bs!r}: {type(e).__name__} after the workers ran: {e}"
        else:
            assert out[0] == 0.0 and out[2].shape == (0,)
        monkeypatch.undo()
    # the scattered-input analogue works
    out = s.f1(s.X_d, s.Y_d, s.W_d, batch=[])
    assert out[0] == 0.0 and out[4].shape == (0,)


def test_index_list_of_mixed_numpy_int_scalars(sess):
    s = sess
    batch = [np.int8(3), np.uint64(1), np.int64(4), np.uint8(1)]
    out = s.f1(s.X_d, s.Y_d, s.W_d, batch=batch, num_slices=2)
    check_f1(s, out, s.X, s.Y, s.W, [3, 1, 4, 1], 2)
