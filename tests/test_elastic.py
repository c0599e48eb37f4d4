"""``synkhronos.elastic``: a training loop that loses a worker (SIGKILL in the middle of the
run) goes on from its last commit with the ranks that are left, and ends where the
undisturbed run ends (the same global batches and learning rate: the same computation, to
rounding); the restart is recorded with its time.  Float64, a tiny model, 12 steps, a
commit every 2."""
import signal

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


def make_loop(kill_at=None, how="kill"):
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
                if how == "kill":
                    killed.append(tu.kill_rank(n - 1))
                else:                                  # frozen: WorkerStopped, at once
                    killed.append(tu.signal_rank(n - 1, signal.SIGSTOP))
        return [np.array(p.get_value()) for p in params]
    return loop


def run(n, kill_at=None, how="kill", **kw):
    state = elastic.State(step=0, losses=[], sizes=[])
    params = elastic.run(setup, make_loop(kill_at, how), state, n_parallel=n, **kw)
    return params, state


@pytest.fixture(scope="module")
def undisturbed():
    return run(3)


@pytest.mark.parametrize("how,error", [("kill", "WorkerDied"), ("stop", "WorkerStopped")])
def test_a_lost_worker_does_not_end_the_run(undisturbed, assert_clean, how, error):
    params, state = run(3, kill_at=7, how=how)
    ref_params, ref_state = undisturbed
    assert state.sizes == [3, 2] and state.step == STEPS
    assert len(state.restarts) == 1
    r = state.restarts[0]
    assert r["lost"] == [2] and r["ranks_before"] == 3 and r["ranks_after"] == 2
    assert r["at"]["step"] == 7 and r["committed"]["step"] == 6 and error in r["error"]
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


def test_demo_killed_worker_continues_to_the_same_accuracy():
    """demos/mnist_mlp.py --elastic at 2 ranks: a worker killed (SIGKILL) after epoch 3 of
    12; the run goes on at 1 rank from the end of the last epoch and reaches the accuracy
    of the undisturbed run; the time lost is printed."""
    import os
    import re
    import signal
    import subprocess
    import sys
    pytest.importorskip("sklearn")
    demo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demos", "mnist_mlp.py")
    cmd = [sys.executable, demo, "--n-parallel", "2", "--epochs", "12", "--hidden", "256", "--no-progress",
           "--elastic"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("SYNK_MODE", None)
    result = re.compile(r"RESULT: test accuracy ([0-9.]+)")
    undisturbed = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert undisturbed.returncode == 0, undisturbed.stdout[-3000:] + undisturbed.stderr[-3000:]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out, killed = [], None
    try:
        for line in proc.stdout:
            out.append(line)
            if killed is None and line.startswith("epoch   3/12"):
                killed = tu.worker_children(proc.pid)[0]
                os.kill(killed, signal.SIGKILL)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = "".join(out)
    assert proc.returncode == 0 and killed is not None, text[-4000:]
    assert "elastic: WorkerDied in epoch" in text and "going on with 1 rank from the end of epoch" in text, text
    lost = re.search(r"elastic: training again ([0-9.]+) s after the loss", text)
    assert lost and float(lost.group(1)) < 60, text
    assert "epoch  12/12" in text
    got = float(result.search(text).group(1))
    want = float(result.search(undisturbed.stdout).group(1))
    assert abs(got - want) <= 0.005, (got, want)
