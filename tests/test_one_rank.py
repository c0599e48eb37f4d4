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


def test_one_rank_training_step_runs_both_functions_itself():
    """A warm training step of one rank runs its gradient and update functions itself (no
    command): the serial step's values, step after step; on CPU ranks an update rule that
    fails leaves the parameters and the gradient as they were (all or nothing)."""
    from pytensor.raise_op import Assert
    from synkhronos.extensions import train, updates
    tu.fork(1)
    try:
        x, y = T.matrix("x"), T.vector("y")
        w = theano.shared(np.zeros(3), name="w")
        ok = theano.shared(np.array(1.0), name="ok")
        loss = T.mean((x.dot(w) - y) ** 2)

        def rule(loss_, params, **kw):
            g_upd, p_upd, g_shared = updates.sgd(loss_, params, **kw)
            if tu.jax_backend():                               # (PyTensor's JAX backend drops Assert)
                return g_upd, p_upd, g_shared
            return g_upd, [(p, Assert("update refused")(v, ok > 0.5)) for p, v in p_upd], g_shared
        step = train.make_train_function(loss, [w], [x, y], rule, learning_rate=0.1)
        synk.distribute()
        rng = np.random.default_rng(3)
        X, Y = rng.standard_normal((8, 3)), rng.standard_normal(8)
        W = np.zeros(3)
        for i in range(4):
            sent = tu.commands_sent("call")
            got = step(X, Y)
            if i:                                              # warm: nothing sent
                assert tu.commands_sent("call") == sent
            want = np.mean((X @ W - Y) ** 2)
            W = W - 0.1 * (2 / len(X)) * X.T @ (X @ W - Y)
            np.testing.assert_allclose(got, want, rtol=1e-12)
            np.testing.assert_allclose(synk.get_value(0, w), W, rtol=1e-12)
        if not tu.jax_backend():
            grad = np.array(synk.get_value(0, step.grad_shared), copy=True)
            before = np.array(synk.get_value(0, w), copy=True)
            synk.set_value(0, ok, np.array(0.0))
            with pytest.raises(Exception, match="update refused"):
                step(X, Y)
            np.testing.assert_array_equal(synk.get_value(0, w), before)
            np.testing.assert_array_equal(synk.get_value(0, step.grad_shared), grad)
            synk.set_value(0, ok, np.array(1.0))
            np.testing.assert_allclose(step(X, Y), np.mean((X @ W - Y) ** 2), rtol=1e-12)
    finally:
        synk.close()


def test_one_rank_batch_s_calls_run_the_function_itself():
    """A warm ``batch_s`` call of one rank over sliceable shareds (the data set kept on the
    device) runs the function itself: the rows selected by an index list or a slice, the
    values of plain PyTensor indexing the same variables; a selection out of range is
    refused before anything runs."""
    tu.fork(1)
    try:
        X = np.arange(20.0).reshape(10, 2)
        xs = theano.shared(X, name="xs")
        w = theano.shared(np.ones(2), name="w")
        x = T.matrix("x")
        f = synk.function([], [(x.dot(w).sum(), "sum"), (x, "gather")], givens=[(x, xs)],
                          sliceable_shareds=[xs], updates=[(w, w + x.mean(axis=0))])
        synk.distribute()
        f(batch_s=[0, 1])                              # compiles: the general path
        W = np.ones(2) + X[[0, 1]].mean(axis=0)
        for sel, rows in (([3, 1, 7], [3, 1, 7]), (slice(2, 6), list(range(2, 6))), (np.array([9]), [9])):
            sent = tu.commands_sent("call")
            s, g = f(batch_s=sel)
            assert tu.commands_sent("call") == sent  # nothing sent: the function itself
            np.testing.assert_allclose(s, X[rows].dot(W).sum())
            np.testing.assert_array_equal(g, X[rows])
            W = W + X[rows].mean(axis=0)
            np.testing.assert_allclose(synk.get_value(0, w), W)
        with pytest.raises(synk.OutOfRange, match="batch_s"):
            f(batch_s=[10])
        np.testing.assert_allclose(synk.get_value(0, w), W)
        s, g = f()                                    # every row: the plain variant
        np.testing.assert_array_equal(g, X)
    finally:
        synk.close()


def test_one_rank_batch_calls_run_the_function_itself():
    """A warm ``batch`` call of one rank (the demos' step: rows of a ``synk.Data`` holding
    the training set) runs the function itself: the rows of an index list, a slice or an
    int, also with a minibatch input and a broadcast input, the values of serial PyTensor
    on those rows and the updates step after step; a selection out of range, or a minibatch
    input shorter than the batch, is refused before anything runs, as in any session."""
    tu.fork(1)
    try:
        rng = np.random.default_rng(3)
        X, Z = rng.standard_normal((12, 3)), rng.standard_normal((5, 3))
        w = theano.shared(np.ones(3), name="w")
        x, z, y = T.matrix("x"), T.matrix("z"), T.vector("y")
        f = synk.function([x], [(x.dot(w).sum(), "sum"), (x * 2, "gather")], bcast_inputs=[y],
                          updates=[(w, w + 0.1 * x.mean(axis=0) * y)])
        g = synk.function([x, z], (x.dot(w) + z.dot(w), "gather"))
        synk.distribute()
        Xd, Zd = synk.data(X), synk.data(Z, minibatch=True)
        Y = np.array([1.0, -1.0, 0.5])
        f(Xd, Y, batch=[0, 1])                        # compiles: the general path
        W = np.ones(3) + 0.1 * X[[0, 1]].mean(axis=0) * Y
        for sel, rows in (([3, 1, 7, 3], [3, 1, 7, 3]), (slice(2, 6), list(range(2, 6))), (4, [0, 1, 2, 3]),
                          (np.array([11]), [11])):
            sent = tu.commands_sent("call")
            s, twice = f(Xd, Y, batch=sel)
            assert tu.commands_sent("call") == sent   # nothing sent: the function itself
            np.testing.assert_allclose(s, X[rows].dot(W).sum())
            np.testing.assert_array_equal(twice, 2 * X[rows])
            W = W + 0.1 * X[rows].mean(axis=0) * Y
            np.testing.assert_allclose(synk.get_value(0, w), W)
        g(Xd, Zd, batch=[0])                          # compiles
        sent = tu.commands_sent("call")
        np.testing.assert_allclose(g(Xd, Zd, batch=[6, 2, 9]), X[[6, 2, 9]].dot(W) + Z[:3].dot(W))
        np.testing.assert_allclose(g(Xd, Zd, batch=slice(7, 12)), X[7:12].dot(W) + Z.dot(W))
        assert tu.commands_sent("call") == sent
        with pytest.raises(synk.OutOfRange, match="out of range"):
            f(Xd, Y, batch=[12])
        with pytest.raises(synk.OutOfRange, match="out of range"):
            f(Xd, Y, batch=slice(10, 13))
        with pytest.raises(ValueError, match="shorter than the batch"):
            g(Xd, Zd, batch=[0, 1, 2, 3, 4, 5])
        np.testing.assert_allclose(synk.get_value(0, w), W)
    finally:
        synk.close()


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning", "ignore:This process:DeprecationWarning")
def test_one_rank_session_has_a_guardian_that_leaves_with_it():   # (the child only sleeps: no lock)
    """A one-rank session has a guardian (a process that frees the session's shared memory
    if the master dies: no worker is there to do it; tested in test_faults_master); it
    leaves at once when the session closes, even while a process that the program forked
    keeps the guardian's pipe open."""
    import os
    import signal
    import time
    tu.fork(1)
    child = None
    try:
        assert len(tu.guardians()) == 1
        child = os.fork()
        if child == 0:                         # a forked child that outlives the session
            time.sleep(30)
            os._exit(0)
        t0 = time.monotonic()
        synk.close()
        assert time.monotonic() - t0 < 2.0
        assert tu.guardians() == []
    finally:
        synk.close()
        if child:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
