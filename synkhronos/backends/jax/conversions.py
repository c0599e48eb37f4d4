"""JAX implementations of ops that PyTensor's JAX backend does not convert, registered in
every process of a JAX session (``register``, from ``runtime.configure``) when the package
that defines the op is importable.

pytensor-ml's ``Im2Col`` / ``Col2Im`` (the window gathers of its convolution and pooling
layers, which the demos' models hold): ``Im2Col`` stacks, for every kernel tap, the strided
slice of the (batch, *spatial, channels) input that the tap sees over all output windows;
``Col2Im`` is its adjoint, adding each tap's slice back at the same place.  Shapes are
static (JAX's), so both compile once per input shape."""
import importlib.util

import numpy as np

_done = set()


def _span(k, d):
    """The input extent one window covers: kernel ``k``, dilation ``d``."""
    return d * (k - 1) + 1


def _tap_slices(tap, outs, stride, dilation):
    """The index of kernel tap ``tap`` over every output window of a (batch, *spatial,
    channels) array."""
    return ((slice(None),)
            + tuple(slice(t * d, t * d + s * (o - 1) + 1, s) for t, o, s, d in zip(tap, outs, stride, dilation))
            + (slice(None),))


def _register_pytensor_ml():
    from pytensor.graph.basic import Constant
    from pytensor.link.jax.dispatch import jax_funcify
    from pytensor_ml.layers.conv import Col2Im, Im2Col

    @jax_funcify.register(Im2Col)
    def _im2col(op, node=None, **kwargs):
        ks, st, dl = op.kernel_size, op.stride, op.dilation
        nd = len(ks)

        def im2col(x):
            import jax.numpy as jnp
            outs = [(x.shape[1 + a] - _span(ks[a], dl[a])) // st[a] + 1 for a in range(nd)]
            taps = [x[_tap_slices(tap, outs, st, dl)] for tap in np.ndindex(*ks)]
            out = jnp.stack(taps, axis=1 + nd)                   # (batch, *windows, taps, channels)
            return out.reshape(out.shape[:1 + nd] + tuple(ks) + out.shape[-1:])
        return im2col

    @jax_funcify.register(Col2Im)
    def _col2im(op, node=None, **kwargs):
        ks, st, dl = op.kernel_size, op.stride, op.dilation
        nd = len(ks)
        known = [int(i.data) if isinstance(i, Constant) else None for i in node.inputs[1:]]

        def col2im(patches, *lengths):
            import jax.numpy as jnp
            outs = patches.shape[1:1 + nd]
            spatial = []
            for a in range(nd):
                size = known[a]
                if size is None:
                    try:                        # a length JAX knows when it compiles (the usual case)
                        size = int(lengths[a])
                    except Exception:           # noqa: BLE001 - traced: the smallest size the windows fit
                        size = st[a] * (outs[a] - 1) + _span(ks[a], dl[a])
                spatial.append(size)
            out = jnp.zeros((patches.shape[0], *spatial, patches.shape[-1]), patches.dtype)
            for tap in np.ndindex(*ks):
                src = patches[(slice(None),) * (1 + nd) + tap + (slice(None),)]
                out = out.at[_tap_slices(tap, outs, st, dl)].add(src)
            return out
        return col2im


_PACKAGES = {"pytensor_ml": _register_pytensor_ml}


def register():
    """Register the conversions of every package here that is importable (once per process),
    the rewrite that keeps arithmetic on shapes static (``static_shapes``) and the one that
    keeps reductions in JAX's width when its x64 mode is off (``narrow_accumulators``)."""
    if "rewrites" not in _done:
        _done.add("rewrites")
        from . import narrow_accumulators, static_shapes
        static_shapes.register()
        narrow_accumulators.register()
    for pkg, fn in _PACKAGES.items():
        if pkg in _done:
            continue
        _done.add(pkg)
        if importlib.util.find_spec(pkg) is not None:
            fn()
