"""The fast path for 0-d outputs (a loss, an accuracy) combines exactly like the array path."""
import warnings

import numpy as np
import pytest

from synkhronos.reductions import combine

DTYPES = ["float16", "float32", "float64", "int8", "int32", "int64", "uint8", "uint64"]
MODES = ["sum", "avg", "prod", "max", "min"]


def _parts(dtype, rng, k):
    info = np.finfo(dtype) if np.dtype(dtype).kind == "f" else np.iinfo(dtype)
    picks = [0, 1, info.max, info.min, rng.integers(-100, 100)]
    if np.dtype(dtype).kind == "f":
        picks += [np.nan, -np.inf, rng.standard_normal() * 1e3, info.tiny]
    return [np.asarray(np.array(picks[rng.integers(len(picks))]).astype(dtype)) for _ in range(k)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_scalar_path_equals_array_path(dtype, mode):
    rng = np.random.default_rng(abs(hash((dtype, mode))) % 2**32)
    for trial in range(60):
        k = int(rng.integers(1, 5))
        parts = _parts(dtype, rng, k)
        weights = [int(w) for w in rng.integers(1, 9, k)] if trial % 2 else None
        with warnings.catch_warnings():
            warnings.simplefilter("error")          # the scalar path warns no more than arrays
            with np.errstate(all="ignore"):
                want = combine(mode, [p.reshape(1) for p in parts], weights)
            with np.errstate(all="ignore"):
                got = combine(mode, parts, weights)
        assert got.dtype == want.dtype and got.shape == ()
        np.testing.assert_array_equal(got, want[0], err_msg=f"{mode} {dtype} {parts} {weights}")
