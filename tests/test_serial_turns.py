"""``serial_snapshot``/``serial_restore`` of a training step: data-parallel steps and two
serial references (``step.serial``) taken in turns, as the demos time them, each serial
run's values kept aside in the master only.  Each run follows the numpy reference of
``test_updates`` as if it ran alone, and the ranks end equal: for the plain step and the
sharded one (whose serial reference keeps its own copy of the rule's state), at 2 and 4
ranks (uneven blocks)."""
import numpy as np
import pytensor.tensor as pt
import pytest

import synkhronos as synk
import synk_testutil as tu
from synkhronos.extensions import train, updates
from test_updates import BATCH, NumpyRule, build_model, check_params, init_params, make_data, np_loss_grads


@pytest.fixture(scope="module", params=[2, 4], ids=["n2", "n4"])
def steps(request):
    tu.fork(request.param)
    try:
        x, y = pt.matrix("x", dtype="float32"), pt.ivector("y")
        out = {}
        for sharded in (False, True):
            loss, params = build_model(x, y, f"turns_{sharded}")
            out[sharded] = train.make_train_function(loss, params, [x, y], updates.adam, shard_updates=sharded)
        synk.distribute()
        yield out
    finally:
        synk.close()


@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "sharded"])
def test_serial_runs_in_turns_run_as_if_alone(steps, sharded):
    step = steps[sharded]
    X, Y = make_data(BATCH, seed=5)
    ref = [p.astype(np.float64) for p in init_params()]
    rule = NumpyRule("adam")
    aside = [step.serial_snapshot()] * 2           # the serial runs' start: the same values
    for k in range(3):
        ref_loss, grads = np_loss_grads(ref, X, Y)
        ref = rule.step(ref, grads)
        np.testing.assert_allclose(step(X, Y), ref_loss, rtol=1e-5, err_msg=f"data-parallel step {k}")
        keep = step.serial_snapshot()
        for run in range(2):
            step.serial_restore(aside[run])
            np.testing.assert_allclose(step.serial(X, Y), ref_loss, rtol=1e-5,
                                       err_msg=f"serial run {run}, step {k}")
            check_params(step, ref, all_ranks=False)   # that run's parameters, in the master
            aside[run] = step.serial_snapshot()
        step.serial_restore(keep)
        check_params(step, ref)                        # the data-parallel run's, on every rank
    with pytest.raises(ValueError, match="serial_restore needs"):
        step.serial_restore(aside[0][:-1])
