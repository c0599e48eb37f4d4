"""``synkhronos.elastic``: a training loop that loses a worker (SIGKILL in the middle of the
run) goes on from its last commit with the ranks that are left, and ends where the
undisturbed run ends (the same global batches and learning rate: the same computation, to
rounding); the restart is recorded with its time.  Float64, a tiny model, 12 steps, a
commit every 2."""
import numpy as np
import pytensor
import pytensor.tensor as T
import pytest

import synkhronos as synk
import synk_testutil as tu
from synkhronos import elastic
from synkhronos.extensions import train, updates

RNG = np.random.default_rng(3)
X = RNG.standard_normal((48, 4))
Y = RNG.integers(0, 3, 48).astype("int32")
STEPS, B = 12, 6


def setup(n):
    rng = np.random.default_rng(0)
    W = pytensor.shared(rng.standard_normal((4, 3)), name="W")
    b = pytensor.shared(np.zeros(3), name="b")
    x, y = T.matrix("x"), T.ivector("y")
    target = T.eq(y[:, None], T.arange(3)).astype("float64")
    loss = T.mean((T.tanh(x.dot(W) + b) - target) ** 2)
    step = train.make_train_function(loss, [W, b], [x, y], updates.adam, learning_rate=0.05)
    synk.distribute()
    return step, [W, b], n


def make_loop(kill_at=None):
    killed = []

    def loop(model, state):
        step, params, n = model
        state.sizes = state.sizes + [n] if state.step == 0 or state.sizes[-1] != n else state.sizes
        while state.step < STEPS:
            rows = slice(state.step * B % len(X), state.step * B % len(X) + B)     # the global batch
            state.losses = state.losses + [float(step(X[rows], Y[rows]))]
            state.step += 1
            if state.step % 2 == 0:
                state.commit()
            if state.step == kill_at and not killed:
                killed.append(tu.kill_rank(n - 1))
        return [np.array(p.get_value()) for p in params]
    return loop


def run(n, kill_at=None, **kw):
    state = elastic.State(step=0, losses=[], sizes=[])
    params = elastic.run(setup, make_loop(kill_at), state, n_parallel=n, **kw)
    return params, state


@pytest.fixture(scope="module")
def undisturbed():
    return run(3)


def test_a_killed_worker_does_not_end_the_run(undisturbed, assert_clean):
    params, state = run(3, kill_at=7)
    ref_params, ref_state = undisturbed
    assert state.sizes == [3, 2] and state.step == STEPS
    assert len(state.restarts) == 1
    r = state.restarts[0]
    assert r["lost"] == [2] and r["ranks_before"] == 3 and r["ranks_after"] == 2
    assert r["at"]["step"] == 7 and r["committed"]["step"] == 6 and "WorkerDied" in r["error"]
    assert 0 < r["seconds_to_resume"] < 60
    np.testing.assert_allclose(state.losses, ref_state.losses, rtol=1e-10)
    for p, q in zip(params, ref_params):
        np.testing.assert_allclose(p, q, rtol=1e-10)
    assert_clean()


def test_replace_keeps_the_number_of_ranks(undisturbed, assert_clean):
    params, state = run(3, kill_at=5, replace=True)
    r = state.restarts[0]
    assert r["ranks_before"] == r["ranks_after"] == 3 and r["committed"]["step"] == 4 and state.sizes == [3]
    for p, q in zip(params, undisturbed[0]):
        np.testing.assert_allclose(p, q, rtol=1e-10)
    assert_clean()


def test_limits_end_the_run(assert_clean):
    with pytest.raises(synk.WorkerDied):
        run(2, kill_at=3, max_restarts=0)
    with pytest.raises(synk.WorkerDied):
        run(2, kill_at=3, min_ranks=2)
    with pytest.raises(TypeError, match="elastic.State"):
        elastic.run(setup, make_loop(), {"step": 0})
    assert_clean()
