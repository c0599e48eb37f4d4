"""Random generators (``RandomType`` shared variables, e.g. a dropout's) on the ranks, on
numba and JAX ranks alike (this module runs in both passes): every rank draws its own
stream and the master's rank the generator's own (what plain PyTensor draws), or every rank
the master's with ``distribute(random_streams="same")``; the shared variable is the one
generator every function of it advances (PyTensor's JAX backend alone would give each
function a private copy that never advances the variable); checkpoints carry the streams
from numba ranks onto JAX ranks and back."""
import numpy as np
import pytensor
import pytensor.tensor as T
import pytest

import synkhronos as synk
import synk_testutil as tu

SEED = 11


def _generator():
    return pytensor.shared(np.random.default_rng(SEED), name="rng")


def _draw(rng, size=3):
    """``(next generator, 3 normal numbers)`` drawn from ``rng``."""
    r_next, noise = T.random.normal(0, 1, size=(size,), rng=rng, return_next_rng=True)
    return r_next, noise


def _gathering(rng):
    """A synk function returning each rank's 3 numbers (rank order), advancing ``rng``."""
    r_next, noise = _draw(rng)
    return synk.function([], (noise, "gather"), updates=[(rng, r_next)])


def _serial(k):
    """The first ``k`` draws of plain PyTensor from the same generator, as the session
    under test compiles (numba, or JAX in the JAX pass)."""
    rng = _generator()
    r_next, noise = _draw(rng)
    mode = "JAX" if tu.jax_backend() else None
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")    # PyTensor JAX: "a copy will be used" (it advances the copy)
        f = pytensor.function([], noise, updates=[(rng, r_next)], mode=mode)
        return [f() for _ in range(k)]


@pytest.mark.parametrize("n", [2, 3])
def test_every_rank_draws_its_own_stream_and_the_master_the_generators(n):
    tu.fork(n)
    try:
        f = _gathering(_generator())
        synk.distribute()
        got = [f().reshape(n, 3) for _ in range(3)]
    finally:
        synk.close()
    for a, b in zip(got, _serial(3)):
        np.testing.assert_allclose(a[0], b, rtol=1e-6)        # the master's rank: plain PyTensor's
    for r in range(1, n):
        for s in range(r):
            assert not np.allclose(got[0][r], got[0][s]), (r, s)
    assert not np.allclose(got[0][1], got[1][1])              # and each rank's stream advances
    tu.fork(n)
    try:                                                      # repeatable: the same streams again
        f = _gathering(_generator())
        synk.distribute()
        np.testing.assert_array_equal(f().reshape(n, 3), got[0])
    finally:
        synk.close()


def test_same_streams_on_request_and_bad_values_refused():
    tu.fork(2)
    try:
        f = _gathering(_generator())
        with pytest.raises(ValueError, match="random_streams must be 'per_rank' or 'same'"):
            synk.distribute(random_streams="each")
        synk.distribute(random_streams="same")
        for want in _serial(2):
            got = f().reshape(2, 3)
            np.testing.assert_allclose(got[0], want, rtol=1e-6)
            np.testing.assert_array_equal(got[1], got[0])
    finally:
        synk.close()


def test_functions_of_one_generator_advance_it_together():
    """Two functions drawing from one generator: the second continues where the first left
    the variable (on JAX ranks too), as two calls of one function would."""
    tu.fork(2)
    try:
        rng = _generator()
        f, g = _gathering(rng), _gathering(rng)
        synk.distribute()
        mixed = [f(), g(), f()]
    finally:
        synk.close()
    tu.fork(2)
    try:
        f = _gathering(_generator())
        synk.distribute()
        for want in mixed:
            np.testing.assert_array_equal(f(), want)
    finally:
        synk.close()


def _after_load(path, mode, n=2):
    synk.fork(n, mode=mode, use_gpu=False)
    try:
        f = _gathering(_generator())
        synk.distribute()
        synk.load(path)
        return [f().reshape(n, 3) for _ in range(2)]
    finally:
        synk.close()


@pytest.mark.skipif(tu.jax_backend(), reason="forks both backends itself: runs in the main pass")
def test_streams_cross_between_numba_and_jax_ranks(tmp_path):
    """Saved by numba ranks, loaded by JAX ranks (each rank its own stream, the same at
    every load), saved there after drawing, loaded by numba ranks again: every step draws
    distinct, finite, repeatable numbers, and the JAX ranks' stream goes on from the key
    they saved."""
    first, second = str(tmp_path / "numba.npz"), str(tmp_path / "jax.npz")
    synk.fork(2, mode=None, use_gpu=False)
    try:
        f = _gathering(_generator())
        synk.distribute()
        f()
        synk.save(first)
    finally:
        synk.close()
    on_jax = _after_load(first, "JAX")
    assert np.isfinite(on_jax).all() and not np.allclose(on_jax[0][0], on_jax[0][1])
    np.testing.assert_array_equal(_after_load(first, "JAX"), on_jax)
    synk.fork(2, mode="JAX", use_gpu=False)
    try:
        f = _gathering(_generator())
        synk.distribute()
        synk.load(first)
        f()
        synk.save(second)
        cont = f().reshape(2, 3)
    finally:
        synk.close()
    np.testing.assert_array_equal(cont, on_jax[1])           # JAX's own key, saved and resumed
    np.testing.assert_array_equal(_after_load(second, "JAX")[0], on_jax[1])
    back = _after_load(second, None)
    assert np.isfinite(back).all() and not np.allclose(back[0][0], back[0][1])
    np.testing.assert_array_equal(_after_load(second, None), back)
