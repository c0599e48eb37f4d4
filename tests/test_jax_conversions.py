"""What synkhronos adds to PyTensor's JAX backend, in one process (no session): the JAX
conversions of pytensor-ml's window ops (``Im2Col``/``Col2Im``) and the rewrite that keeps
integer arithmetic on shapes static (``arange``, slice bounds and sizes computed from
shapes), each against PyTensor's Python implementations on the same graph, values and
gradients, over several shapes (one compile per shape)."""
import numpy as np
import pytest
import pytensor
import pytensor.tensor as pt

pytest.importorskip("jax")
from synkhronos.backends.jax import conversions  # noqa: E402

conversions.register()
PY = "FAST_COMPILE"          # PyTensor's own (Python / NumPy) implementations: the reference


def both(inputs, outputs):
    return (pytensor.function(inputs, outputs, mode="JAX"), pytensor.function(inputs, outputs, mode=PY))


def check(fj, fp, *args):
    for got, want in zip(fj(*args), fp(*args)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("rows", [3, 7, 12])
def test_shape_arithmetic_stays_static(rows):
    x = pt.matrix("x")
    k = x.shape[0] * 2 // 3
    outs = [pt.arange(k) * 1.0,                               # an arange over arithmetic on shapes
            pt.arange(1, x.shape[1] + x.shape[0], 2) * 1.0,
            x[:k].sum(axis=0),                                # a slice bound
            x[k // 2:x.shape[0] - 1:2].sum(),
            pt.zeros((x.shape[0] * 3, x.shape[1] + 1)).sum(axis=1),   # a size
            x.reshape((x.shape[0] * x.shape[1] // 2, -1)).sum(axis=1),
            pt.arange(x.shape[0]) * 1.0]                      # (PyTensor's own conversion)
    fj, fp = both([x], outs)
    check(fj, fp, np.random.default_rng(rows).standard_normal((rows, 4)))


def test_gradient_through_a_slice_of_shape_arithmetic():
    x = pt.matrix("x")
    y = (x[: x.shape[0] * 2 // 3] ** 2).sum() + pt.tanh(x[x.shape[0] // 2:]).sum()
    fj, fp = both([x], [y, pytensor.grad(y, x)])
    for rows in (3, 5, 8):
        check(fj, fp, np.random.default_rng(rows).standard_normal((rows, 2)))


@pytest.mark.parametrize("kernel,stride,dilation", [((2, 2), (2, 2), (1, 1)), ((3, 3), (1, 1), (1, 1)),
                                                     ((3, 2), (2, 1), (1, 2))])
def test_window_ops_values_and_gradients(kernel, stride, dilation):
    from pytensor_ml.layers.conv import Im2Col
    x = pt.tensor4("x")                                       # (batch, height, width, channels)
    w = pt.tensor3("w")
    patches = Im2Col(kernel, stride, dilation)(x)             # (batch, *windows, *kernel, channels)
    y = (pt.tanh(patches) * w.dimshuffle("x", "x", "x", 0, 1, 2)).sum()
    fj, fp = both([x, w], [patches, y] + pytensor.grad(y, [x, w]))   # Col2Im: the gradient
    rng = np.random.default_rng(sum(kernel))
    W = rng.standard_normal((*kernel, 3))
    for batch, h, wd in ((2, 7, 6), (1, 9, 9)):
        check(fj, fp, rng.standard_normal((batch, h, wd, 3)), W)


def test_max_pooling_layer_compiles_on_jax():
    """pytensor-ml's max pooling: its tap count comes from a reshape's size arithmetic."""
    pytest.importorskip("pytensor_ml")
    from pytensor_ml.layers import MaxPool2D
    x = pt.tensor4("x")
    y = MaxPool2D("pool", kernel_size=2)(x)
    g = pytensor.grad((y ** 2).sum(), x)
    fj, fp = both([x], [y, g])
    check(fj, fp, np.random.default_rng(0).standard_normal((2, 6, 4, 3)))


def test_float32_session_prints_no_jax_warning():
    """floatX=float32 leaves JAX's x64 mode off; PyTensor's float64 accumulators made every
    trace warn ("Explicitly requested dtype float64 ...").  The intro example's graph, on JAX
    CPU ranks and in plain PyTensor JAX, with every warning an error: none."""
    import subprocess
    import sys
    prog = ("import numpy as np, pytensor, pytensor.tensor as T, synkhronos as synk\n"
            "synk.fork(2, mode='JAX', use_gpu=False)\n"
            "x, y = T.matrix('x'), T.matrix('y')\n"
            "f = synk.function([x], [T.mean(x.dot(y), axis=0), (T.sum(x), 'sum'), (T.prod(x, axis=1), 'gather')],"
            " bcast_inputs=[y])\n"
            "synk.distribute()\n"
            "X, Y = np.ones((10, 3), 'float32'), np.ones((3, 4), 'float32')\n"
            "m, s, p = f(X, Y)\n"
            "assert m.dtype == np.float32 and float(s) == 30.0 and p.shape == (10,), (m, s, p)\n"
            "assert np.allclose(f.as_theano(X, Y)[0], m)\n"
            "synk.close()\n"
            "print('ok')\n")
    import synk_testutil as tu
    env = tu.program_env(floatX="float32")
    env.pop("SYNK_MODE", None)
    proc = subprocess.run([sys.executable, "-W", "error", "-c", prog], capture_output=True, text=True,
                          timeout=240, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr[-3000:]
    assert "Warning" not in proc.stderr, proc.stderr[-3000:]
