"""The documentation's introductory example, nearly verbatim (``theano`` is PyTensor now).

The docs ran on GPUs with floatX=float32 and build ``T.matrix('x')`` with floatX, then feed
float32 data; we set floatX=float32 for the example so the same lines apply unchanged.
The README variant (default floatX, data cast to floatX) runs in the same session."""
import os

import numpy as np
import pytensor as theano
import pytensor.tensor as T

import synkhronos as synk


def _usable_cores():
    return len(os.sched_getaffinity(0))


def test_introductory_example(capsys, assert_clean):
    many = _usable_cores() > 4
    try:
        # --- the docs' example -------------------------------------------------------
        n = synk.fork(2) if many else synk.fork()        # docs: synk.fork()
        assert n == (2 if many else _usable_cores())
        with theano.config.change_flags(floatX="float32"):
            x = T.matrix('x')
            y = T.vector('y')
        z = T.mean(x.dot(y), axis=0)
        f_th = theano.function(inputs=[x, y], outputs=z)
        f = synk.function(inputs=[x], bcast_inputs=[y], outputs=z)

        # --- the README's variant (floatX left at its default) -------------------------
        x2 = T.matrix('x')
        y2 = T.vector('y')
        z2 = T.mean(x2.dot(y2), axis=0)
        f2_th = theano.function(inputs=[x2, y2], outputs=z2)
        f2 = synk.function(inputs=[x2], bcast_inputs=[y2], outputs=z2)

        synk.distribute()

        x_dat = np.random.randn(100, 10).astype('float32')
        y_dat = np.random.randn(10).astype('float32')
        x_synk = synk.data(x_dat)
        y_synk = synk.data(y_dat)
        r_th = f_th(x_dat, y_dat)
        r = f(x_synk, y_synk)

        assert np.allclose(r, r_th)
        assert np.ndim(r) == 0 and r.dtype == np.float32
        # independent numpy reference too
        assert np.allclose(r, np.mean(x_dat.astype(np.float64) @ y_dat.astype(np.float64)), rtol=1e-4)

        x2_dat = np.random.randn(100, 10).astype(theano.config.floatX)
        y2_dat = np.random.randn(10).astype(theano.config.floatX)
        r2 = f2(synk.data(x2_dat), synk.data(y2_dat))
        assert np.allclose(r2, f2_th(x2_dat, y2_dat))

        out = capsys.readouterr().out
        assert "Synkhronos distributing functions..." in out
        assert "...distribution complete" in out
    finally:
        synk.close()
    assert synk.session_info() is None
    assert_clean()
