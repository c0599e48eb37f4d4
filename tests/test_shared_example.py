"""The documentation's "Theano Shared Variable Example", with its printed values.

    synk.fork(2)
    s_init = np.ones(2, dtype='float32')
    x = T.matrix('x')
    s = theano.shared(s_init, name='s')
    f = synk.function([x], updates=[(s, T.sum(x * s, axis=0))])
    synk.distribute()
    ...

(``x`` is float32 here: the documentation ran Theano with floatX=float32.)"""
import numpy as np
import pytensor as theano
import pytensor.tensor as T

import synkhronos as synk


def test_theano_shared_variable_example(capsys):
    synk.fork(2)
    try:
        s_init = np.ones(2, dtype="float32")
        x = T.matrix("x", dtype="float32")
        s = theano.shared(s_init, name="s")
        f = synk.function([x], updates=[(s, T.sum(x * s, axis=0))])
        synk.distribute()
        x_dat = synk.data(np.array([[1, 1],
                                    [2, 2],
                                    [3, 3],
                                    [4, 4]]).astype("float32"))

        # s initial: [ 1.  1.]
        np.testing.assert_array_equal(s.get_value(), [1, 1])

        # s after Theano call: [ 10.  10.]
        f.as_theano(x_dat.data)
        np.testing.assert_array_equal(s.get_value(), [10, 10])

        # local s after reset and Synkhronos call: [ 3.  3.]
        s.set_value(s_init)
        f(x_dat)
        np.testing.assert_array_equal(s.get_value(), [3, 3])

        # gathered s: [[ 3.  3.] [ 7.  7.]]
        gathered_s = synk.gather(s, nd_up=1)
        np.testing.assert_array_equal(gathered_s, [[3, 3], [7, 7]])

        # local s after in-place reduce: [ 10.  10.]
        synk.reduce(s, op="sum")
        np.testing.assert_array_equal(s.get_value(), [10, 10])

        # gathered s after reduce: [[ 10.  10.] [  7.   7.]]
        gathered_s = synk.gather(s, nd_up=1)
        np.testing.assert_array_equal(gathered_s, [[10, 10], [7, 7]])

        # gathered s after local reset, broadcast, Synkhronos call, and all-reduce:
        # [[ 10.  10.] [ 10.  10.]]
        synk.broadcast(s, s_init)
        f(x_dat)
        synk.all_reduce(s, op="sum")
        gathered_s = synk.gather(s, nd_up=1)
        np.testing.assert_array_equal(gathered_s, [[10, 10], [10, 10]])

        for value in (s.get_value(), gathered_s):
            assert value.dtype == np.float32
        np.testing.assert_array_equal(s_init, [1, 1])      # the user's array was never written
        print("\ngathered s:\n", gathered_s)
        assert "[[10. 10.]\n [10. 10.]]" in capsys.readouterr().out
    finally:
        synk.close()
