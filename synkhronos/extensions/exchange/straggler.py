"""``straggle(x, {rank: seconds})``: an identity op that sleeps on the given ranks, to
simulate a slow worker (tests and demos), with its numba and JAX implementations."""
import sys
import time

import pytensor.tensor as pt
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op

from synkhronos.rank import current as current_rank


class Straggle(Op):
    """``straggle(x, {rank: seconds})``: ``x`` unchanged; computing it sleeps ``seconds`` on
    those ranks (inside a synkhronos call; never in plain PyTensor use).  For tests and
    demos of slow workers."""

    __props__ = ("delays",)
    view_map = {0: [0]}

    def __init__(self, delays):
        self.delays = tuple(sorted((int(r), float(s)) for r, s in dict(delays).items()))

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        _straggle_sleep(self.delays)
        outputs[0][0] = inputs[0]

    def pullback(self, inputs, outputs, output_grads):
        return [output_grads[0]]

    def infer_shape(self, *args):      # (node, shapes); older PyTensor: (fgraph, node, shapes)
        return [args[-1][0]]


def _straggle_sleep(delays):
    me = current_rank()
    if me is None:
        return
    for rank, seconds in delays:
        if rank == me.rank and seconds > 0:
            time.sleep(seconds)


def straggle(x, delays):
    """``x``, computed ``delays[rank]`` seconds late on the given ranks (see ``Straggle``)."""
    _register_straggle_jax(importing=True)
    return Straggle(delays)(x)


def _register_straggle_numba():
    try:
        import numba
        from pytensor.link.numba.dispatch.basic import register_funcify_default_op_cache_key
    except ImportError:          # pragma: no cover - the other backends call perform
        return

    @register_funcify_default_op_cache_key(Straggle)
    def numba_funcify_straggle(op, node, **kwargs):
        delays = op.delays

        def straggle_impl(x):
            with numba.objmode():
                _straggle_sleep(delays)
            return x
        from pytensor.link.numba.dispatch.basic import numba_njit
        return numba_njit(straggle_impl), 1


_register_straggle_numba()
_jax_registered = False


def _register_straggle_jax(importing=False):
    """Straggle for PyTensor's JAX backend: a host callback that sleeps.  Registered when
    JAX is already loaded (a JAX rank unpickling a graph) or when a graph uses straggle
    (``importing``: JAX is loaded then, if installed)."""
    global _jax_registered
    if _jax_registered or not (importing or "jax" in sys.modules):
        return
    try:
        import jax
        from pytensor.link.jax.dispatch import jax_funcify
    except ImportError:
        return
    _jax_registered = True

    @jax_funcify.register(Straggle)
    def jax_funcify_straggle(op, **kwargs):
        delays = op.delays

        def sleep_then(x):
            _straggle_sleep(delays)
            return x

        def straggle_impl(x):
            return jax.pure_callback(sleep_then, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return straggle_impl


_register_straggle_jax()
