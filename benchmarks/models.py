"""The models the training benchmarks time (``bench_training.py``, ``bench_step_parts.py``):
the demos' MLP and CNN, built by the demos' own model builders so that the benchmarks time
those very models, and the two MLPs of the comparison with PyTorch; their softmax
cross-entropy, and training sets of random values shaped for them."""
import os
import sys

import numpy as np

# the demos' folder: the demos' model builders (demos/mnist_mlp.py, demos/layers.py)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demos"))

N_IN, N_ROWS = 64, 8192          # 8x8 images, enough rows for any batch here

# The models: the demos' two, and the two of the comparison with PyTorch (``--torch``):
# ``sizes`` are the layer widths of a relu MLP (the last layer linear); ``steps_factor``
# multiplies the steps per timed run (a tiny model's step is too short to time alone).
MODELS = {
    "mlp": dict(desc="MLP 64-1024-1024-10 (demos/mnist_mlp.py)", sizes=(N_IN, 1024, 1024, 10)),
    "cnn": dict(desc="CNN conv3x3(16)-pool-conv3x3(32)-pool-dense(128)-10 (demos/mnist_cnn.py)",
                n_in=N_IN, n_out=10),
    "mlp784": dict(desc="MLP 784-512-512-10", sizes=(784, 512, 512, 10)),
    "tiny": dict(desc="MLP 16-16-2", sizes=(16, 16, 2), steps_factor=10, plot="time"),
}
for _m in MODELS.values():
    if "sizes" in _m:
        _m["n_in"], _m["n_out"] = _m["sizes"][0], _m["sizes"][-1]


def build(model, x, seed=0):
    """(y, loss, params) of one of ``MODELS`` on the float32 input matrix ``x``: softmax
    cross-entropy, mean over the rows."""
    import pytensor.tensor as pt
    y = pt.ivector("y")
    if model == "mlp":
        from mnist_mlp import build_mlp
        params, forward = build_mlp(N_IN, 1024, 10, seed)
        logits = forward(x)
    elif model == "cnn":
        import layers
        m = layers.cnn(x, 8, 8, channels=(16, 32), hidden=128, seed=seed)
        params, logits = m.params, m.logits
    else:
        from mnist_mlp import mlp_params      # a relu MLP initialised as the demo's
        params, forward = mlp_params(MODELS[model]["sizes"], seed)
        logits = forward(x)
    logp = pt.special.log_softmax(logits, axis=-1)
    return y, pt.mean(-logp[pt.arange(y.shape[0]), y]), params


def model_data(model, rng):
    """A training set shaped for ``model``: random values (throughput does not depend on
    them), ``N_ROWS`` rows, int32 labels."""
    m = MODELS[model]
    X = rng.random((N_ROWS, m["n_in"]), dtype=np.float32)
    Y = rng.integers(0, m["n_out"], N_ROWS).astype(np.int32)
    return X, Y
