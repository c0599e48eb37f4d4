"""JAX implementations of pytensor-ml's ``Im2Col``/``Col2Im`` for the demos' step-time check
(``benchmarks/gpu_check.py``).  The demos inline pytensor-ml's layers (``demos/layers.py``),
so their graphs hold these window gathers, for which PyTensor's JAX backend has no
conversion.  This directory goes on ``PYTHONPATH`` for the demo runs only: every process of
them (the master and its workers) registers the conversions at start-up."""
try:
    import numpy as _np
    from pytensor.graph.basic import Constant as _Constant
    from pytensor.link.jax.dispatch import jax_funcify as _jax_funcify
    from pytensor_ml.layers.conv import Col2Im as _Col2Im, Im2Col as _Im2Col
except Exception:          # noqa: BLE001 - not this environment: nothing to register
    _Im2Col = None

if _Im2Col is not None:
    def _span(k, d):
        return d * (k - 1) + 1

    def _window(tap, outs, st, dl):
        """The index of kernel tap ``tap`` over every output window: (batch, *spatial, channels)."""
        return ((slice(None),) + tuple(slice(t * d, t * d + s * (o - 1) + 1, s)
                                       for t, o, s, d in zip(tap, outs, st, dl)) + (slice(None),))

    @_jax_funcify.register(_Im2Col)
    def _jax_im2col(op, node=None, **kwargs):
        ks, st, dl = op.kernel_size, op.stride, op.dilation
        n = len(ks)

        def im2col(x):
            import jax.numpy as jnp
            outs = [(x.shape[1 + a] - _span(ks[a], dl[a])) // st[a] + 1 for a in range(n)]
            taps = [x[_window(tap, outs, st, dl)] for tap in _np.ndindex(*ks)]   # (batch, *windows, channels)
            out = jnp.stack(taps, axis=1 + n)              # (batch, *windows, taps, channels)
            return out.reshape(out.shape[:1 + n] + tuple(ks) + out.shape[-1:])
        return im2col

    @_jax_funcify.register(_Col2Im)
    def _jax_col2im(op, node=None, **kwargs):
        ks, st, dl = op.kernel_size, op.stride, op.dilation
        n = len(ks)
        static = [int(i.data) if isinstance(i, _Constant) else None for i in node.inputs[1:]]

        def col2im(patches, *lengths):
            import jax.numpy as jnp
            outs = patches.shape[1:1 + n]
            spatial = []
            for a in range(n):
                size = static[a]
                if size is None:
                    try:                       # a shape JAX knows statically (the usual case)
                        size = int(lengths[a])
                    except Exception:          # noqa: BLE001 - traced: the smallest consistent size
                        size = st[a] * (outs[a] - 1) + _span(ks[a], dl[a])
                spatial.append(size)
            out = jnp.zeros((patches.shape[0], *spatial, patches.shape[-1]), patches.dtype)
            for tap in _np.ndindex(*ks):
                src = patches[(slice(None),) * (1 + n) + tap + (slice(None),)]
                out = out.at[_window(tap, outs, st, dl)].add(src)
            return out
        return col2im
