"""A rank's share of a large collective over several threads (``SYNK_REDUCE_THREADS``): the
same values as numpy, for every op and dtype the host path reduces, in a session whose
ranks split their chunks (two threads a rank, 8-16 MB values)."""
import numpy as np
import pytensor
import pytest

import synkhronos as synk
import synk_testutil as tu

COUNT = (1 << 21) + 37          # not a multiple of anything: pieces end mid cache line


@pytest.fixture(scope="module")
def S():
    mp = pytest.MonkeyPatch()
    mp.setenv("SYNK_REDUCE_THREADS", "2")          # (the ranks inherit it)
    tu.fork(2)
    try:
        vs = {dt: pytensor.shared(np.zeros(1, dt), name=f"v_{dt}") for dt in ("float32", "float64", "int32",
                                                                                 "float16")}
        for v in vs.values():
            synk.function([], v.sum())
        synk.distribute()
        yield vs
    finally:
        synk.close()
        mp.undo()


@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "float16"])
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "prod"])
def test_threaded_all_reduce_equals_numpy(S, dtype, op):
    rng = np.random.default_rng(abs(hash((dtype, op))) % 2 ** 32)
    parts = rng.integers(-3, 4, (2, COUNT)).astype(dtype)
    synk.scatter(S[dtype], parts.reshape(-1))
    synk.all_reduce(S[dtype], op)
    got = synk.gather(S[dtype], nd_up=1)
    if op == "avg":
        want = (parts.astype(np.float64).sum(0) / 2).astype(dtype) if dtype != "int32" else \
            np.rint(parts.sum(0) / 2).astype(dtype)
    else:
        want = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}[op](parts, axis=0).astype(dtype)
    np.testing.assert_array_equal(got[0], got[1])
    np.testing.assert_array_equal(got[0], want)


def test_threaded_reduce_to_the_master_equals_numpy(S):
    parts = np.arange(2 * COUNT, dtype=np.float64).reshape(2, COUNT) % 977
    synk.scatter(S["float64"], parts.reshape(-1))
    np.testing.assert_array_equal(synk.reduce(S["float64"], "sum", in_place=False), parts.sum(0))
    synk.reduce(S["float64"], "max")
    np.testing.assert_array_equal(synk.get_value(0, S["float64"]), parts.max(0))
    np.testing.assert_array_equal(synk.get_value(1, S["float64"]), parts[1])
