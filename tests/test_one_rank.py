"""One-rank sessions (one GPU, or one CPU rank): a warm call without selections runs the
compiled function directly, without a command or staging, with the semantics of the
general path."""
import numpy as np
import pytensor as theano
import pytensor.tensor as T
import pytest

import synkhronos as synk
import synk_testutil as tu


def test_one_rank_calls_run_the_function_itself():
    """In a one-rank session a warm call without selections runs the compiled function
    directly (no command): the outputs of the general path (a first call, num_slices),
    the updates applied once a call, and a call that fails applies nothing."""
    tu.fork(1)
    try:
        x, y = T.vector("x"), T.vector("y")
        c = theano.shared(np.zeros(2), name="c")
        f = synk.function([x], [(x.sum(), "sum"), (x * 2, "gather"), (c.sum(), None), (x.max(), "max")],
                          bcast_inputs=[y], updates=[(c, c + x[:2] * y)])
        synk.distribute()
        X, Y = np.arange(6.0), np.ones(2)
        first = f(X, Y)                               # compiles: the general path
        sent = tu.commands_sent("call")
        direct = f(X, Y)
        assert tu.commands_sent("call") == sent       # nothing sent: the function itself
        sliced = f(X, Y, num_slices=2)                # the general path again (updates: the slices' mean)
        for a, b, c_before in zip((first, direct, sliced), (first, first, first), (0.0, 1.0, 2.0)):
            np.testing.assert_allclose(a[0], 15.0)
            np.testing.assert_array_equal(a[1], 2 * X)
            assert a[2] == c_before and a[3] == 5.0
        with pytest.raises(Exception):
            f(X, np.ones(3))                          # fails inside the function: nothing applied
        np.testing.assert_array_equal(synk.get_value(0, c), [1.5, 4.5])
        assert f(X, Y)[2] == 6.0
    finally:
        synk.close()
