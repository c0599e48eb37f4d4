"""``synk.data`` and ``Data``: creation, casting, shapes and allocation, freeing, and that
shared memory goes away when a Data is dropped.  One fork (n=2) for the module."""
import gc
import os
import types

import numpy as np
import pytest
import pytensor.tensor as T

import synkhronos as synk
import synk_testutil as tu


@pytest.fixture(scope="module")
def S():
    tu.fork(2)
    try:
        a = T.vector("a", dtype="float32")
        b = T.vector("b", dtype="float32")
        f7 = synk.function([a, b], (T.sum(a * b), "sum"))
        a8 = T.vector("a", dtype="float32")
        c8 = T.scalar("c", dtype="float32")
        f8 = synk.function([a8], (T.sum(a8 * c8), "sum"), bcast_inputs=[c8])
        synk.distribute()
        yield types.SimpleNamespace(f7=f7, f8=f8, prefix=tu.prefix(), a=a, c8=c8,
                                    worker_pid=tu.pid_of(1))
    finally:
        synk.close()


def _shm_path(d):
    return tu.backing_file(d.data)


def _segments(S):
    """Data segments of this session currently in /dev/shm."""
    return [e for e in tu.shm_entries(S.prefix) if "_d" in e[len(S.prefix.lstrip("/")):]]


# ---- creation -------------------------------------------------------------------------------

def test_data_before_fork_is_an_error():
    if synk.session_info() is not None:
        pytest.skip("a session is open (module fixture already started)")
    with pytest.raises(RuntimeError, match="fork"):
        synk.data(np.zeros(3))


def test_numpy_like_surface(S):
    v = np.arange(12, dtype=np.float32).reshape(4, 3)
    d = synk.data(v, name="v")
    assert isinstance(d, synk.Data)
    assert d.shape == (4, 3) and d.dtype == np.float32 and d.ndim == 2 and d.size == 12
    assert len(d) == 4 and d.name == "v" and d.minibatch is False
    assert d.alloc_size >= d.size
    np.testing.assert_array_equal(d.data, v)
    np.testing.assert_array_equal(np.asarray(d), v)
    np.testing.assert_array_equal(d[1:3, ::2], v[1:3, ::2])
    assert d[2, 1] == v[2, 1]
    d[0] = -1
    d[1:3, 2] = [7, 8]
    assert d.data[0].tolist() == [-1, -1, -1] and d[2, 2] == 8
    d.data[3, 0] = 99                     # the numpy view is the shared memory itself
    assert d[3, 0] == 99
    assert "v" in repr(d)
    assert os.path.exists(_shm_path(d))
    assert d.data is not v                # a copy, in shared memory
    v[0, 0] = 123
    assert d[0, 0] == -1


def test_dtype_ndim_and_name_from_var(S):
    d = synk.data(var=S.a)
    assert d.dtype == np.float32 and d.ndim == 1 and d.name == "a" and d.shape == (0,)
    d = synk.data(np.array([1, 2, 3], dtype=np.int16), var=S.a)   # safe cast to the var's dtype
    assert d.dtype == np.float32 and d.data.tolist() == [1, 2, 3]
    with pytest.raises(ValueError):
        synk.data(var=S.a, dtype="float64")
    with pytest.raises(ValueError):
        synk.data(var=S.a, ndim=2)
    with pytest.raises(TypeError):
        synk.data(var="not a variable")
    d = synk.data(dtype="int32", ndim=2, minibatch=True, name="m")
    assert d.shape == (0, 0) and d.minibatch and d.name == "m" and d.alloc_size == 0
    with pytest.raises(TypeError, match="dtype"):
        synk.data()
    with pytest.raises(TypeError):
        synk.data(dtype="float32")          # ndim missing


def test_shape_alone_allocates_zeros(S):
    d = synk.data(dtype="float32", shape=(3, 4))
    assert d.shape == (3, 4) and d.ndim == 2 and d.alloc_size == 12
    np.testing.assert_array_equal(d.data, np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError):
        synk.data(np.zeros((2, 2), np.float32), shape=(3, 3))


def test_empty_arrays(S):
    d = synk.data(np.zeros((0, 3), dtype=np.float32))
    assert d.shape == (0, 3) and d.size == 0 and len(d) == 0 and d.ndim == 2
    e = synk.data(np.zeros(0, dtype=np.float32))
    assert e.shape == (0,) and len(e) == 0
    assert float(S.f7(e, e)) == 0.0               # an empty batch, as serial PyTensor
    e.set_value(np.arange(4, dtype=np.float32))   # grows from nothing
    assert e.shape == (4,) and e.alloc_size >= 4
    assert float(S.f7(e, e)) == 14.0


def test_zero_dim_data(S):
    d = synk.data(np.float32(3.5))
    assert d.ndim == 0 and d.shape == () and d.size == 1 and d.dtype == np.float32
    assert d.data == np.float32(3.5) and float(np.asarray(d)) == 3.5 and d[()] == 3.5
    with pytest.raises(TypeError):
        len(d)
    d.set_value(np.float32(-1))
    assert d[()] == -1
    with pytest.raises(ValueError):
        d.set_length(1)


def test_zero_dim_data_lives_in_shared_memory(S):
    d = synk.data(np.float32(2.5))
    assert d.alloc_size >= d.size == 1
    assert os.path.exists(_shm_path(d))
    e = synk.data(dtype="float32", ndim=0)
    e.set_value(np.float32(2.5))
    assert e.alloc_size == 1
    A = np.arange(1, 9, dtype=np.float32)
    assert S.f8(synk.data(A), d) == pytest.approx(float(A.sum()) * 2.5)


# ---- casting ----------------------------------------------------------------------------------

@pytest.mark.parametrize("src,dst", [("uint8", "int32"), ("int16", "int64"), ("int32", "float64"),
                                     ("int64", "float64"), ("float32", "float64"), ("bool", "int8"),
                                     ("uint8", "float32")])
def test_safe_up_cast_accepted(S, src, dst):
    v = np.array([0, 1, 2, 1], dtype=src)
    d = synk.data(v, dtype=dst)
    assert d.dtype == np.dtype(dst)
    np.testing.assert_array_equal(d.data, v.astype(dst))
    d.set_value(v[::-1])
    np.testing.assert_array_equal(d.data, v[::-1].astype(dst))


@pytest.mark.parametrize("src,dst", [("float64", "float32"), ("int64", "int32"), ("float32", "int32"),
                                     ("int32", "uint32"), ("float64", "int64"), ("int64", "float32")])
def test_down_cast_rejected_unless_force_cast(S, src, dst):
    v = np.array([1, 2, 3], dtype=src)
    with pytest.raises(TypeError):
        synk.data(v, dtype=dst)
    d = synk.data(dtype=dst, ndim=1)
    with pytest.raises(TypeError):
        d.set_value(v)
    with pytest.raises(TypeError):
        d.condition_data(v)
    d.set_value(v, force_cast=True)
    assert d.dtype == np.dtype(dst)
    np.testing.assert_array_equal(d.data, v.astype(dst))
    d2 = synk.data(v, dtype=dst, force_cast=True)
    np.testing.assert_array_equal(d2.data, v.astype(dst))


def test_python_values_cast_within_kind(S):
    d = synk.data([0.5, 1.5], dtype="float32")
    assert d.dtype == np.float32 and d.data.tolist() == [0.5, 1.5]
    d = synk.data([1, 2, 3], dtype="uint8")
    assert d.dtype == np.uint8
    with pytest.raises(TypeError):
        synk.data([1.5], dtype="int32")        # float -> int is not a cast within the kind
    with pytest.raises(TypeError):
        synk.data([300], dtype="uint8")        # out of range


def test_condition_data_is_a_dry_run(S):
    d = synk.data(np.zeros(3, np.float64))
    arr = d.condition_data(np.array([1, 2], dtype=np.int32))
    assert arr.dtype == np.float64 and arr.tolist() == [1.0, 2.0]
    assert d.shape == (3,) and d.data.tolist() == [0, 0, 0]
    arr = d.condition_data(np.array([1.7], np.float32), force_cast=False)
    assert arr.dtype == np.float64
    with pytest.raises(TypeError):
        d.condition_data(np.zeros((2, 2)))


def test_wrong_ndim_rejected(S):
    with pytest.raises(TypeError, match="dimensions"):
        synk.data(np.zeros(3, np.float32), ndim=2)
    d = synk.data(np.zeros((2, 2), np.float32))
    with pytest.raises(TypeError, match="dimensions"):
        d.set_value(np.zeros(4, np.float32))
    with pytest.raises(TypeError):
        d.set_value(np.float32(1))
    with pytest.raises(ValueError):
        d.set_shape((4,))
    with pytest.raises(ValueError):
        d.set_shape((2, -1))
    with pytest.raises(ValueError):
        d.set_length(-1)
    assert d.shape == (2, 2)


@pytest.mark.parametrize("bad", [2.5, "3", np.float64(3.9)])
def test_non_integer_length_rejected(S, bad):
    d = synk.data(np.arange(5, dtype=np.float32))
    with pytest.raises(TypeError):
        d.set_length(bad)
    with pytest.raises(TypeError):
        d.set_shape((bad,))
    with pytest.raises(TypeError):
        synk.data(dtype="float32", shape=(bad, 2))
    assert d.shape == (5,)


def test_integer_like_lengths_accepted(S):
    d = synk.data(np.arange(5, dtype=np.float32))
    d.set_length(np.int64(3))
    assert d.shape == (3,)
    d.set_shape([np.int32(4)])
    assert d.shape == (4,)
    with pytest.raises(TypeError):
        d.set_length(None)


# ---- oversize, set_shape, set_length, free_memory -----------------------------------------------

@pytest.mark.parametrize("bad", [0, 0.5, 0.99, 2.01, 3, -1, True, "2", None, float("nan")])
def test_oversize_validation(S, bad):
    v = np.arange(10, dtype=np.int32)
    with pytest.raises(ValueError, match="oversize"):
        synk.data(v, oversize=bad)
    d = synk.data(v)
    with pytest.raises(ValueError, match="oversize"):
        d.set_value(np.arange(50, dtype=np.int32), oversize=bad)
    with pytest.raises(ValueError, match="oversize"):
        d.set_length(40, oversize=bad)
    with pytest.raises(ValueError, match="oversize"):
        d.set_shape((40,), oversize=bad)
    assert d.shape == (10,) and d.data.tolist() == list(range(10))


@pytest.mark.parametrize("oversize,alloc", [(1, 10), (1.5, 15), (2, 20), (np.float32(1.2), 12)])
def test_oversize_reserves_room(S, oversize, alloc):
    d = synk.data(np.arange(10, dtype=np.int32), oversize=oversize)
    assert d.alloc_size == alloc and d.shape == (10,)


def test_set_length_reuses_allocation_when_it_fits(S):
    d = synk.data(np.arange(10, dtype=np.float32), oversize=2)
    assert d.alloc_size == 20
    path = _shm_path(d)
    d.set_length(17)
    assert d.shape == (17,) and d.alloc_size == 20 and _shm_path(d) == path
    np.testing.assert_array_equal(d[:10], np.arange(10))
    d.set_length(4)
    assert d.shape == (4,) and d.alloc_size == 20 and _shm_path(d) == path
    np.testing.assert_array_equal(d.data, np.arange(4))
    d.set_length(20)
    assert d.alloc_size == 20 and _shm_path(d) == path
    # growing past the allocation reallocates and keeps the rows
    d.set_length(4)
    d.set_length(30)
    assert d.shape == (30,) and d.alloc_size >= 30 and _shm_path(d) != path
    np.testing.assert_array_equal(d[:4], np.arange(4))
    assert not os.path.exists(path), "the old segment was not removed"


def test_set_length_2d_keeps_rows_on_realloc(S):
    v = np.arange(12, dtype=np.int64).reshape(4, 3)
    d = synk.data(v)
    d.set_length(9, oversize=1.5)
    assert d.shape == (9, 3) and d.alloc_size == int(27 * 1.5)
    np.testing.assert_array_equal(d[:4], v)
    d.set_length(2)
    assert d.alloc_size == int(27 * 1.5)
    np.testing.assert_array_equal(d.data, v[:2])


def test_set_shape_fit_and_grow(S):
    d = synk.data(np.arange(12, dtype=np.float64).reshape(4, 3))
    assert d.alloc_size == 12
    path = _shm_path(d)
    d.set_shape((2, 6))
    assert d.shape == (2, 6) and d.alloc_size == 12 and _shm_path(d) == path
    np.testing.assert_array_equal(d.data.ravel(), np.arange(12))   # same memory, reinterpreted
    d.set_shape((3, 2))
    assert d.alloc_size == 12 and _shm_path(d) == path
    d.set_shape([5, 5], oversize=2)
    assert d.shape == (5, 5) and d.alloc_size == 50 and _shm_path(d) != path
    assert not os.path.exists(path)
    d.set_shape((0, 5))
    assert d.shape == (0, 5) and d.alloc_size == 50


def test_set_value_reuses_allocation_when_it_fits(S):
    d = synk.data(np.arange(8, dtype=np.int32), oversize=1.5)
    assert d.alloc_size == 12
    path = _shm_path(d)
    d.set_value(np.arange(12, dtype=np.int32)[::-1])
    assert d.alloc_size == 12 and _shm_path(d) == path
    assert d.data.tolist() == list(range(11, -1, -1))
    d.set_value(np.array([5], dtype=np.int32))
    assert d.shape == (1,) and d.alloc_size == 12 and d.data.tolist() == [5]
    d.set_value(np.arange(13, dtype=np.int32))
    assert d.alloc_size == 13 and _shm_path(d) != path and d.data.tolist() == list(range(13))


def test_free_memory(S):
    d = synk.data(np.ones((4, 2), dtype=np.float32))
    path = _shm_path(d)
    assert os.path.exists(path)
    d.free_memory()
    assert d.alloc_size == 0 and d.size == 0 and d.shape == (0, 0) and d.ndim == 2
    assert not os.path.exists(path)
    d.free_memory()                        # twice is fine
    d.set_value(np.full((3, 2), 2, np.float32))
    assert d.shape == (3, 2) and d.alloc_size == 6 and os.path.exists(_shm_path(d))
    assert float(S.f7(np.ones(3, np.float32), d[:, 0].copy())) == 6.0


def test_workers_see_resized_and_rewritten_data(S):
    A = synk.data(np.arange(4, dtype=np.float32), oversize=2)
    B = synk.data(np.ones(4, dtype=np.float32))
    assert S.f7(A, B) == 6.0
    A.set_length(7)                        # fits: same segment, new rows written in place
    A[4:] = [4, 5, 6]
    B.set_value(np.ones(7, dtype=np.float32))   # grows: a new segment
    assert S.f7(A, B) == 21.0
    A[:] = 2                               # written in place, seen by the workers
    assert S.f7(A, B) == 14.0
    A.set_value(np.arange(20, dtype=np.float32))
    B.set_value(np.arange(20, dtype=np.float32))
    assert S.f7(A, B) == float(np.sum(np.arange(20) ** 2))
    B.free_memory()
    B.set_value(np.full(20, 2, np.float32))
    assert S.f7(A, B) == float(2 * np.arange(20).sum())
    A.set_length(3)
    B.set_length(3)
    assert S.f7(A, B) == 6.0


# ---- dropping Data releases its shared memory ---------------------------------------------------

def test_dropping_data_removes_its_segment(S):
    d = synk.data(np.arange(100, dtype=np.float64))
    path = _shm_path(d)
    assert os.path.exists(path)
    assert S.f7(np.ones(3, np.float32), np.ones(3, np.float32)) == 3.0
    del d
    gc.collect()
    assert not os.path.exists(path)
    # the workers drop their mapping with the next command
    assert S.f7(np.ones(3, np.float32), np.ones(3, np.float32)) == 3.0
    assert not any(path in m for m in tu.mapped_shm(S.worker_pid, S.prefix))


def test_no_accumulation_over_200_data(S):
    gc.collect()
    before = len(_segments(S))
    ones = synk.data(np.ones(50, np.float32))
    for i in range(200):
        d = synk.data(np.full(50, i, dtype=np.float32), oversize=1 + (i % 3) / 2)
        if i % 20 == 0:
            d.set_length(120)                        # a reallocation too
            d.set_length(50)
        assert S.f7(d, ones) == pytest.approx(50.0 * i)   # the workers map it
        del d
    gc.collect()
    assert S.f7(ones, ones) == 50.0                   # the workers forget the dropped ones
    assert len(_segments(S)) <= before + 1            # only `ones` is new
    mapped = tu.mapped_shm(S.worker_pid, S.prefix)
    print("worker maps", sorted(mapped))
    assert len(mapped) < 15, f"worker still maps {len(mapped)} segments of this session"
    del ones
    gc.collect()
    assert len(_segments(S)) <= before
