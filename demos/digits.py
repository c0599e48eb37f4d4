"""Real handwritten digits, with no download.

``load(mnist_dir=None, seed=0)`` returns ``{"train": (X, y), "valid": (X, y), "test": (X, y),
"name": str, "shape": (h, w)}`` with ``X`` float32 in [0, 1] of shape (n, h*w) and ``y``
int32 labels 0-9.

* default: scikit-learn's bundled ``load_digits()`` (1797 8x8 images from UCI's optical
  digits, shipped inside scikit-learn), split with a fixed seed into 1299 train, 249 valid
  and 249 test images (stratified by class);
* ``mnist_dir``: the real MNIST idx files, if you have them (``train-images-idx3-ubyte``,
  ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each
  optionally ``.gz``; the ``train-images.idx3-ubyte`` spelling works too).  The last 10000
  training images are the validation set, the 10000 t10k images the test set.
"""
import gzip
import os

import numpy as np

N_VALID_DIGITS = 250
N_TEST_DIGITS = 250


def load(mnist_dir=None, seed=0):
    if mnist_dir is not None:
        return load_mnist(mnist_dir)
    return load_sklearn_digits(seed)


def load_sklearn_digits(seed=0):
    from sklearn.datasets import load_digits
    d = load_digits()
    X = (d.data / 16.0).astype(np.float32)          # pixel values are 0..16
    y = d.target.astype(np.int32)
    # stratified split: the same class proportions in every part, fixed by the seed
    rng = np.random.default_rng(seed)
    parts = {"train": [], "valid": [], "test": []}
    n = len(y)
    for c in range(10):
        idx = rng.permutation(np.flatnonzero(y == c))
        n_va = round(N_VALID_DIGITS * len(idx) / n)
        n_te = round(N_TEST_DIGITS * len(idx) / n)
        parts["valid"].append(idx[:n_va])
        parts["test"].append(idx[n_va:n_va + n_te])
        parts["train"].append(idx[n_va + n_te:])
    out = {}
    for k, v in parts.items():
        idx = rng.permutation(np.concatenate(v))
        out[k] = (X[idx], y[idx])
    out["name"] = "scikit-learn digits (8x8)"
    out["shape"] = (8, 8)
    return out


def _find(mnist_dir, stem):
    names = [stem, stem.replace("-idx", ".idx")]
    for nm in names:
        for cand in (nm, nm + ".gz"):
            path = os.path.join(mnist_dir, cand)
            if os.path.exists(path):
                return path
    raise FileNotFoundError(f"no {stem}[.gz] in {mnist_dir!r} (expected the MNIST idx files)")


def read_idx(path):
    """Array from an idx file (ubyte data, as MNIST uses), gzipped or not."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte idx file")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(dims)):
        raise ValueError(f"{path}: {data.size} values but the header says {dims}")
    return data.reshape(dims)


def load_mnist(mnist_dir):
    xs = read_idx(_find(mnist_dir, "train-images-idx3-ubyte"))
    ys = read_idx(_find(mnist_dir, "train-labels-idx1-ubyte"))
    xt = read_idx(_find(mnist_dir, "t10k-images-idx3-ubyte"))
    yt = read_idx(_find(mnist_dir, "t10k-labels-idx1-ubyte"))
    h, w = xs.shape[1:]

    def prep(x, y):
        return (x.reshape(len(x), h * w).astype(np.float32) / 255.0), y.astype(np.int32)

    X, y = prep(xs, ys)
    return {"train": (X[:-10000], y[:-10000]), "valid": (X[-10000:], y[-10000:]),
            "test": prep(xt, yt), "name": "MNIST (28x28)", "shape": (h, w)}


if __name__ == "__main__":
    import sys
    d = load(sys.argv[1] if len(sys.argv) > 1 else None)
    for k in ("train", "valid", "test"):
        X, y = d[k]
        print(f"{d['name']} {k}: X {X.shape} {X.dtype} [{X.min():.2f}, {X.max():.2f}], "
              f"y {y.shape} {y.dtype} counts {np.bincount(y, minlength=10).tolist()}")


def resize(data, size):
    """The data set with every image resized to ``size`` x ``size`` (bilinear, scipy)."""
    from scipy.ndimage import zoom
    h, w = data["shape"]
    if (h, w) == (size, size):
        return data
    out = dict(data)
    for part in ("train", "valid", "test"):
        X, y = data[part]
        imgs = zoom(X.reshape(-1, h, w), (1, size / h, size / w), order=1, grid_mode=True,
                    mode="grid-constant")
        out[part] = (np.ascontiguousarray(np.clip(imgs, 0, 1).reshape(len(X), size * size),
                                          dtype=np.float32), y)
    out["shape"] = (size, size)
    out["name"] = f"{data['name']} resized to {size}x{size}"
    return out
