"""Sharded updates (ZeRO stage 1): ``make_train_function(..., shard_updates=True)``.

Every rule of ``updates``, at 1, 2, 3 and 4 ranks, against the independent numpy
reference of ``test_updates`` (the same MLP of 87 parameters: blocks of 44/43 numbers at 2
ranks, 22/22/22/21 at 4): the losses and the parameters of every rank track it step for
step; each rank holds only its block of the rule's state (``synk.get_lengths``: 1/n of the
numbers); ``get_value`` gives whole parameters.  Snapshot/restore and a checkpoint written
at 2 ranks and resumed at 3 and 1 continue the uninterrupted run; the serial reference
(``step.serial``) gives the same step; what cannot work is refused before any rank runs."""
import numpy as np
import pytensor.tensor as pt
import pytest

import synkhronos as synk
import synk_testutil as tu
from synkhronos.extensions import train, updates
from test_updates import RTOL, ATOL, RULES, STEPS, NumpyRule, build_model, check_params, init_params, \
    make_data, np_loss_grads

BATCH = 12                      # equal shards at 1..4 ranks: the average is the batch's gradient
N_PARAMS = sum(p.size for p in init_params())


def blocks(n, N=N_PARAMS):
    return [((r + 1) * N) // n - (r * N) // n for r in range(n)]


def build_steps(names, tag=""):
    x, y = pt.matrix("x", dtype="float32"), pt.ivector("y")
    steps = {}
    for name in names:
        loss, params = build_model(x, y, f"{name}{tag}")
        steps[name] = train.make_train_function(loss, params, [x, y], getattr(updates, name),
                                                shard_updates=True, **RULES[name])
    return steps


# 2 and 4 ranks (uneven blocks) in every run; 1 and 3 with the slow tests
@pytest.fixture(scope="module", params=[2, 4, pytest.param(1, marks=pytest.mark.slow),
                                        pytest.param(3, marks=pytest.mark.slow)], ids=lambda n: f"n{n}")
def session(request):
    tu.fork(request.param)
    try:
        steps = build_steps(RULES)
        synk.distribute()
        yield request.param, steps
    finally:
        synk.close()


def test_distribute_splits_the_state(session):
    """Right after ``distribute()``, before any step: each rank holds its block only."""
    n, steps = session
    for step in steps.values():
        for v in step.sharded_vars:
            assert synk.get_lengths(v) == blocks(n), v.name


@pytest.mark.parametrize("name", list(RULES))
def test_rule_tracks_the_reference(session, name):
    n, steps = session
    step = steps[name]
    X, Y = make_data(BATCH)
    ref = [p.astype(np.float64) for p in init_params()]
    rule = NumpyRule(name, **RULES[name])
    for k in range(STEPS):
        loss = step(X, Y)
        ref_loss, grads = np_loss_grads(ref, X, Y)
        ref = rule.step(ref, grads)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=f"step {k}")
        check_params(step, ref)            # whole parameters, equal on every rank
    per_param = {"sgd": 0, "momentum": 1, "nesterov_momentum": 1, "adagrad": 1, "rmsprop": 1,
                 "adadelta": 2, "adam": 2, "adamax": 2}[name]
    assert len(step.sharded_vars) == per_param
    for v in step.sharded_vars:             # each rank holds its block of the state: 1/n of it
        assert synk.get_lengths(v) == blocks(n), v.name
    assert step.grad_shared is None and step.update_function is None


def test_snapshot_restore_and_serial(session):
    n, steps = session
    step = steps["adam"]
    X, Y = make_data(BATCH, seed=3)
    snap = step.snapshot()                 # sharded state gathered whole
    assert [a.shape for a in snap[-len(step.sharded_vars) - 1:-1]] != []
    first = float(step(X, Y))
    after = [p.get_value() for p in step.params]
    step.restore(snap)
    assert float(step(X, Y)) == pytest.approx(first, rel=1e-6)
    for p, a in zip(step.params, after):
        np.testing.assert_allclose(p.get_value(), a, rtol=RTOL, atol=ATOL)
    for v in step.sharded_vars:
        assert synk.get_lengths(v) == blocks(n)
    step.restore(snap)
    serial = float(step.serial(X, Y))      # plain PyTensor in the master, own whole state
    assert serial == pytest.approx(first, rel=1e-5)


def test_refused_before_any_rank_runs(session):
    n, steps = session
    X, Y = make_data(BATCH)
    with pytest.raises(ValueError, match="num_slices"):
        steps["sgd"](X, Y, num_slices=2)
    if n > 1:                          # a rank without rows could not meet the others
        with pytest.raises(ValueError, match="in-graph collectives"):
            steps["sgd"](X[:n - 1], Y[:n - 1])
    before = [np.asarray(p.get_value(), dtype=np.float64) for p in steps["sgd"].params]
    loss = steps["sgd"](X[:n], Y[:n])  # one row a rank
    ref_loss, grads = np_loss_grads(before, X[:n], Y[:n])
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
    check_params(steps["sgd"], NumpyRule("sgd", **RULES["sgd"]).step(before, grads))
    x, y = pt.matrix("x", dtype="float32"), pt.ivector("y")
    loss, params = build_model(x, y, "refused")
    with pytest.raises(ValueError, match="bsp"):
        train.make_train_function(loss, params, [x, y], updates.sgd, learning_rate=0.1,
                                  shard_updates=True, exchange="fp16")
    with pytest.raises(ValueError, match="sgd_nonflat"):
        train.make_train_function(loss, params, [x, y], updates.sgd_nonflat, learning_rate=0.1,
                                  shard_updates=True)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_uneven_shards_track_the_reference(session, name):
    """Batches that split unevenly over the ranks (n + 1, 2n + 3 and 5n - 1 rows): the
    gradient each rank contributes weighs by its rows, so the step is the whole batch's
    (each rank's mean gradient had an equal weight: wrong by up to ~10% here); snapshot and
    restore of a rule without state (sgd: it raised)."""
    n, steps = session
    step = steps[name]
    snap = step.snapshot()
    X, Y = make_data(5 * n + 4, seed=5)
    ref = [np.asarray(p.get_value(), dtype=np.float64) for p in step.params]
    rule = NumpyRule(name, **RULES[name])
    # the parameters as the tests before left them, the rule's state new (as the reference's)
    step.restore([val if any(var is p for p in step.params) else np.zeros_like(val)
                  for var, val in zip(step.state_vars, snap)])
    for rows in (n + 1, 2 * n + 3, 5 * n - 1):
        loss = step(X[:rows], Y[:rows])
        ref_loss, grads = np_loss_grads(ref, X[:rows], Y[:rows])
        ref = rule.step(ref, grads)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=f"{rows} rows")
        check_params(step, ref)
    step.restore(snap)
    for p, s in zip(step.params, snap):
        np.testing.assert_array_equal(p.get_value(), s)
