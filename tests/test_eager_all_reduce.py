"""All-reduces on both sides of the one-meeting limit (128 KB a rank, divided by n - 1):
below it a value takes one meeting, above it the shared-memory slots.  Whichever way, the
same numbers, element for element, and numpy's: float16 up to its largest finite value
(sums beyond it are inf, as in numpy, and no rank prints a warning about it), int32
averages, one element, none."""
import json
import subprocess
import sys

import numpy as np
import pytensor
import pytensor.tensor as T
import pytest

import synkhronos as synk
import synk_testutil as tu

LIMIT = 128 * 1024            # bytes a rank (docs/architecture.rst)
DTYPES = ("float16", "float32", "int32")


@pytest.fixture(scope="module", params=[2, 3], ids=["n2", "n3"])
def S(request):
    n = request.param
    tu.fork(n)
    try:
        vs = {dt: pytensor.shared(np.zeros(1, dt), name=f"edge_{dt}") for dt in DTYPES}
        synk.function([], outputs=[T.sum(v) for v in vs.values()])     # registers them (no call)
        synk.distribute()
        yield n, vs
    finally:
        synk.close()


def values(dtype, n, size, rng):
    """Each rank's values: float16 near +-65504 in part (their sums leave its range),
    int32 up to 1e6, float32 of mixed magnitude."""
    if dtype == "float16":
        v = [rng.uniform(-65504, 65504, size) for _ in range(n)]
        for x in v:
            x[: size // 8] = 65504.0
        return [x.astype(np.float16) for x in v]
    if dtype == "int32":
        return [rng.integers(-10**6, 10**6, size).astype(np.int32) for _ in range(n)]
    return [(rng.standard_normal(size) * 10.0 ** rng.integers(-3, 4, size)).astype(np.float32) for _ in range(n)]


def reference(op, parts, dtype):
    wide = np.stack(parts).astype(np.float64)
    if op == "max":
        return wide.max(0).astype(dtype)
    total = wide.sum(0) / (len(parts) if op == "avg" else 1)
    if dtype == "int32":
        return np.rint(total).astype(dtype)
    with np.errstate(over="ignore"):
        return total.astype(dtype)


def close(got, want, parts, op, what):
    """``got`` within rounding of ``want``: for floats, the result's own rounding plus
    float32's (the accumulator) on the sum of magnitudes; infinities alike; int averages
    within one of the rounded mean."""
    if got.dtype.kind == "i":
        assert np.abs(got.astype(np.int64) - want).max(initial=0) <= (1 if op == "avg" else 0), what
        return
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want), err_msg=what)
    fin = np.isfinite(want)
    mags = np.abs(np.stack(parts).astype(np.float64)).sum(0) / (len(parts) if op == "avg" else 1)
    bound = np.finfo(got.dtype).eps * np.abs(want.astype(np.float64)) + 4 * np.finfo(np.float32).eps * mags
    err = np.abs(got[fin].astype(np.float64) - want[fin].astype(np.float64))
    assert (err <= bound[fin]).all(), (what, err.max(initial=0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_same_numbers_on_both_sides_of_the_limit(S, dtype, op):
    n, vs = S
    v = vs[dtype]
    limit = LIMIT // (n - 1) // np.dtype(dtype).itemsize       # elements
    sizes = [0, 1, limit - 32, limit, limit + 32, 2 * limit]
    full = values(dtype, n, sizes[-1], np.random.default_rng(7 + n))
    got = {}
    for size in sizes:
        parts = [x[:size] for x in full]
        for r in range(n):
            synk.set_value(r, v, parts[r])
        synk.all_reduce(v, op=op)
        each = [np.asarray(synk.get_value(r, v)) for r in range(n)]
        for r in range(1, n):
            np.testing.assert_array_equal(each[r], each[0], err_msg=f"{size} elements: rank {r}")
        got[size] = each[0]
        assert got[size].dtype == np.dtype(dtype) and got[size].shape == (size,)
        close(got[size], reference(op, parts, dtype), parts, op, f"{size} elements")
    for size in sizes:           # the same numbers whichever way the value went
        np.testing.assert_array_equal(got[size], got[sizes[-1]][:size], err_msg=f"{size} elements")


_OVERFLOW = """
import json, os, numpy as np, pytensor, pytensor.tensor as T, synkhronos as synk
mode = os.environ.get("SYNK_MODE") or None
synk.fork(2, mode=mode)
sizes = (8, 100_000)                       # one meeting; the slots (200 KB)
vs = [pytensor.shared(np.zeros(s, np.float16), name=f"v{s}") for s in sizes]
x = T.matrix("x", dtype="float16")
g = synk.function([x], (x.sum(axis=0), "sum"))   # each rank 40000: summed in the master
synk.function([], [v.sum() for v in vs])
synk.distribute()
out = {}
for s, v in zip(sizes, vs):
    for op in ("sum", "avg"):
        for r in range(2):
            synk.set_value(r, v, np.full(s, 40000, np.float16))
        synk.all_reduce(v, op=op)
        out[f"{s} {op}"] = [np.unique(synk.get_value(r, v)).tolist() for r in range(2)]
if mode == "JAX":                          # (numba graphs take no float16)
    out["output"] = np.unique(g(np.full((2, 5), 40000, np.float16))).tolist()
synk.close()
print("RESULT", json.dumps(out))
"""


def test_float16_overflow_is_inf_without_a_warning():
    """40000 + 40000 in float16 is inf (numpy's float16 add gives the same), the average
    40000, on one meeting and on the slots, on every rank and (JAX ranks: numba graphs take
    no float16) in an output summed in the master; nothing printed by any process (the
    ranks' warnings reach the master's stderr, where a user cannot act on them)."""
    p = subprocess.run([sys.executable, "-c", _OVERFLOW], env=tu.program_env(), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT"))
    inf = float("inf")
    want = {f"{s} {op}": [[v], [v]] for s in (8, 100_000) for op, v in (("sum", inf), ("avg", 40000.0))}
    if tu.BACKEND == "JAX":
        want["output"] = [inf]
    assert json.loads(line[len("RESULT "):]) == want
    assert "Warning" not in p.stderr, p.stderr[-3000:]
