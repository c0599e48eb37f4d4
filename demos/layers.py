"""The models of the CNN and ResNet demos, built from pytensor-ml layers, ready for synkhronos.

The layers are pytensor-ml's (``pip install pytensor-ml``, in the ``demos`` extra):
``Conv2D``, ``BatchNorm``, ``MaxPool2D`` and ``Linear``, channels-last (images are
``(batch, height, width, channels)``).  This module adds what a data-parallel demo needs:

* ``inline_layers(outputs)``: pytensor-ml builds every layer as an ``OpFromGraph`` (and
  ``padding="same"`` uses PyTensor's ``pt.pad``, another ``OpFromGraph``).  Where such an op
  has no gradient of its own, differentiating it makes PyTensor cache a locally defined
  function on the op, and a compiled function holding that op can no longer be pickled,
  which ``synk.distribute()`` must do to send it to the workers.  So the graphs are
  *inlined* (each layer replaced by the graph inside it) before they are differentiated;
  what remains is ordinary PyTensor ops plus pytensor-ml's ``Im2Col``/``Col2Im`` window
  gathers, which pickle and which the numba backend compiles.  (In one measurement it also
  shortened the first, JIT, compile of the small CNN's gradient on a cold cache from about
  120 s to 85 s.)
* batch normalization with running statistics: in training every rank normalizes its own
  share of the batch with that share's mean and variance (as PyTorch's DDP without
  SyncBatchNorm does) and updates its own copy of the running mean and variance (an
  exponential moving average, momentum 0.1).  These copies are *not* synchronized by the
  training step; the demos' harness (``harness.run``) averages them over the ranks (one
  ``synk.all_reduce``) before every evaluation, which then normalizes with the running statistics
  (``eval_logits``, through pytensor-ml's ``rewrite_for_prediction``).  The average of the
  ranks' running means is the running mean of whole batches; the average of their
  variances leaves out the spread between the ranks' means, so it is slightly low.
* the architectures: ``cnn`` (two conv + max-pool stages and a dense layer), ``resnet``
  (a small ResNet of basic blocks for 8x8 digits) and ``resnet50`` (ResNet-50: the
  ImageNet stem and the [3, 4, 6, 3] bottleneck stages, 10 classes), with He-normal
  weights from one seed.
"""
import numpy as np

try:
    import pytensor_ml
except ImportError as e:           # pragma: no cover - depends on the environment
    raise ImportError("these demos build their models with pytensor-ml: "
                      "pip install pytensor-ml  (or: ./scripts/setup.sh demos)") from e

import pytensor.tensor as pt
from pytensor.compile.builders import OpFromGraph
from pytensor.compile.rewriting import inline_ofg_node
from pytensor.graph.fg import FunctionGraph
from pytensor.graph.rewriting.basic import dfs_rewriter, node_rewriter
from pytensor.tensor.pad import Pad
from pytensor_ml.base import LayerOp
from pytensor_ml.layers import BatchNorm, Conv2D, Linear, MaxPool2D
from pytensor_ml.pytensorf import (collect_non_trainable_params, collect_non_trainable_updates,
                                   collect_trainable_params, rewrite_for_prediction)

del pytensor_ml                    # imported for its side effects: numba implementations, rewrites

__all__ = ["inline_layers", "Model", "cnn", "resnet", "resnet50", "count_params"]


# ------------------------------------------------------------------------------------------
# Inlining


@node_rewriter([OpFromGraph])
def _inline_layer(fgraph, node):
    if isinstance(node.op, (LayerOp, Pad)):
        return inline_ofg_node(node)
    return False


def inline_layers(outputs):
    """The graphs of ``outputs`` (a list) with every pytensor-ml layer op and ``Pad``
    replaced by its inner graph; shared variables and inputs are kept (not copied)."""
    fg = FunctionGraph(outputs=list(outputs), clone=True, copy_inputs=False, copy_orphans=False)
    dfs_rewriter(_inline_layer).rewrite(fg)
    return list(fg.outputs)


# ------------------------------------------------------------------------------------------
# Model


class Model:
    """A network ``net(images) -> logits`` applied to a flat float32 input matrix.

    ``x`` is ``(batch, h * w)`` (a row per image, as ``demos/digits.py`` gives them); the
    model reshapes it to ``(batch, h, w, 1)``.  Attributes:

    * ``logits``: the training graph (batch statistics), inlined;
    * ``stat_updates``: ``[(running_stat, new_value)]`` of the batch-norm layers (empty
      without batch norm), inlined;
    * ``eval_logits``: the inference graph (running statistics), inlined;
    * ``params``: the trainable shared variables; ``stats``: the running statistics.
    """

    def __init__(self, net, x, h, w, seed, description):
        img = x.reshape((-1, h, w, 1))
        logits = net(img)
        ups = collect_non_trainable_updates([logits])
        stats = list(ups)
        eval_logits = rewrite_for_prediction(logits)
        out = inline_layers([logits, eval_logits] + [ups[s] for s in stats])
        self.logits, self.eval_logits = out[0], out[1]
        self.stat_updates = list(zip(stats, out[2:]))
        self.stats = stats
        missing = [s for s in collect_non_trainable_params(logits) if s not in ups]
        if missing:                                     # pragma: no cover - pytensor-ml change
            raise RuntimeError(f"running statistics without an update: {missing}")
        self.params = collect_trainable_params(logits)
        self.description = description
        he_init(self.params, seed)

    def n_params(self):
        return count_params(self.params)


def count_params(params):
    return int(sum(p.get_value(borrow=True).size for p in params))


def he_init(params, seed):
    """He-normal weights (std sqrt(2 / fan_in)) for ReLU layers, std sqrt(1 / fan_in) for
    the output layer (named ``out``); zero biases and shifts, unit batch-norm scales."""
    rng = np.random.default_rng(seed)
    for p in sorted(params, key=lambda v: v.name):     # a fixed order, whatever the graph's
        v = p.get_value(borrow=True)
        if p.name.endswith("_W"):
            fan_in = int(np.prod(v.shape[:-1]))
            gain = 1.0 if p.name.startswith("out_") else 2.0
            new = rng.normal(0.0, np.sqrt(gain / fan_in), v.shape)
        elif p.name.endswith("_scale"):
            new = np.ones(v.shape)
        else:                                            # _b, _loc
            new = np.zeros(v.shape)
        p.set_value(new.astype(v.dtype))


def _relu(h):
    return pt.maximum(h, 0)


# ------------------------------------------------------------------------------------------
# Architectures


def cnn(x, h, w, channels=(16, 32), hidden=128, seed=0):
    """conv3x3-relu-maxpool2 per entry of ``channels``, then dense-relu (``hidden``) and a
    10-way output layer."""
    convs, c_in = [], 1
    for i, c in enumerate(channels):
        convs.append(Conv2D(f"conv{i + 1}", in_channels=c_in, out_channels=c, kernel_size=3,
                            padding="same"))
        c_in = c
    pools = [MaxPool2D(f"pool{i + 1}", kernel_size=2) for i in range(len(channels))]
    hh, ww = h, w
    for _ in channels:
        hh, ww = hh // 2, ww // 2
    if hh < 1 or ww < 1:
        raise ValueError(f"{len(channels)} max-pool stages shrink {h}x{w} images to nothing")
    fc = Linear("fc", n_in=hh * ww * c_in, n_out=hidden)
    out = Linear("out", n_in=hidden, n_out=10)

    def net(img):
        z = img
        for conv, pool in zip(convs, pools):
            z = pool(_relu(conv(z)))
        z = z.reshape((z.shape[0], -1))
        return out(_relu(fc(z)))

    desc = (f"CNN {h}x{w}x1 -> " + " -> ".join(f"conv3x3({c})-pool" for c in channels)
            + f" -> dense({hidden}) -> 10")
    return Model(net, x, h, w, seed, desc)


class _ConvBN:
    """conv (no bias) then batch norm."""

    def __init__(self, name, c_in, c_out, k, stride=1):
        self.conv = Conv2D(f"{name}_conv", in_channels=c_in, out_channels=c_out, kernel_size=k,
                           stride=stride, padding="same", bias=False)
        self.bn = BatchNorm(f"{name}_bn", n_in=c_out)

    def __call__(self, z):
        return self.bn(self.conv(z))


class _BasicBlock:
    """ResNet basic block: 3x3 conv-bn-relu, 3x3 conv-bn, plus the shortcut, relu."""

    def __init__(self, name, c_in, c_out, stride):
        self.a = _ConvBN(f"{name}a", c_in, c_out, 3, stride)
        self.b = _ConvBN(f"{name}b", c_out, c_out, 3)
        self.proj = (_ConvBN(f"{name}proj", c_in, c_out, 1, stride)
                     if stride != 1 or c_in != c_out else None)

    def __call__(self, z):
        short = z if self.proj is None else self.proj(z)
        return _relu(self.b(_relu(self.a(z))) + short)


class _Bottleneck:
    """ResNet-50 bottleneck block: 1x1 conv-bn-relu, 3x3 conv(stride)-bn-relu, 1x1 conv-bn
    (4x wider), plus the shortcut (projected where the shape changes), relu."""

    def __init__(self, name, c_in, width, stride):
        c_out = 4 * width
        self.a = _ConvBN(f"{name}a", c_in, width, 1)
        self.b = _ConvBN(f"{name}b", width, width, 3, stride)
        self.c = _ConvBN(f"{name}c", width, c_out, 1)
        self.proj = (_ConvBN(f"{name}proj", c_in, c_out, 1, stride)
                     if stride != 1 or c_in != c_out else None)

    def __call__(self, z):
        short = z if self.proj is None else self.proj(z)
        return _relu(self.c(_relu(self.b(_relu(self.a(z))))) + short)


def resnet(x, h, w, width=8, blocks=(1, 1), seed=0):
    """A small ResNet for small images: a 3x3 conv-bn-relu stem with ``width`` channels,
    then one stage per entry of ``blocks`` (that many basic blocks; every stage after the
    first halves the resolution and doubles the channels), global average pooling and a
    10-way output layer."""
    stem = _ConvBN("stem", 1, width, 3)
    stages, c_in = [], width
    for s, nb in enumerate(blocks):
        c_out = width * 2 ** s
        for k in range(nb):
            stages.append(_BasicBlock(f"s{s + 1}b{k + 1}", c_in, c_out, 2 if (s > 0 and k == 0) else 1))
            c_in = c_out
    out = Linear("out", n_in=c_in, n_out=10)

    def net(img):
        z = _relu(stem(img))
        for blk in stages:
            z = blk(z)
        return out(pt.mean(z, axis=(1, 2)))

    desc = (f"ResNet {h}x{w}x1: stem conv3x3({width}), stages "
            + ", ".join(f"{nb} basic block(s) x {width * 2 ** s} ch" for s, nb in enumerate(blocks))
            + ", global avg pool -> 10; batch norm after every conv")
    return Model(net, x, h, w, seed, desc)


def resnet50(x, h, w, seed=0):
    """ResNet-50 (He et al. 2016; torchvision's v1.5, stride in the 3x3 conv): 7x7/2 conv
    (64) - bn - relu - 3x3/2 max pool, bottleneck stages of [3, 4, 6, 3] blocks with widths
    64, 128, 256, 512 (outputs 256 ... 2048 channels), global average pooling, and a
    10-way output layer (one input channel).  Made for 32x32 or larger images."""
    stem = _ConvBN("stem", 1, 64, 7, 2)
    pool = MaxPool2D("stem_pool", kernel_size=3, stride=2, padding="same")
    stages, c_in = [], 64
    for s, (nb, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
        for k in range(nb):
            stages.append(_Bottleneck(f"s{s + 1}b{k + 1}", c_in, width, 2 if (s > 0 and k == 0) else 1))
            c_in = 4 * width
    out = Linear("out", n_in=c_in, n_out=10)

    def net(img):
        z = pool(_relu(stem(img)))
        for blk in stages:
            z = blk(z)
        return out(pt.mean(z, axis=(1, 2)))

    desc = (f"ResNet-50 {h}x{w}x1: conv7x7/2(64)-maxpool3x3/2, bottleneck stages [3, 4, 6, 3] "
            "(256, 512, 1024, 2048 ch), global avg pool -> 10; batch norm after every conv")
    return Model(net, x, h, w, seed, desc)
