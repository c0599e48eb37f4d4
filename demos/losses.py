"""The demos' classification loss, written so that every PyTensor backend compiles it.

``logp[arange(len(y)), y]`` picks each row's label, but its ``arange`` has a length that
JAX must know when it compiles and does not (PyTensor's JAX backend refuses it); the same
pick as a product with the one-hot of ``y`` over a fixed number of classes has no such
length, costs ``classes`` multiply-adds per row, and has a plain elementwise gradient."""
import pytensor.tensor as pt


def picked(values, labels, classes):
    """``values[i, labels[i]]`` for every row ``i`` of ``values`` (rows x ``classes``);
    0 for a label outside ``[0, classes)``."""
    one_hot = pt.eq(labels[:, None], pt.arange(classes, dtype=labels.dtype))
    return pt.sum(values * pt.cast(one_hot, values.dtype), axis=-1)
