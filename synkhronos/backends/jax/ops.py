"""An op for graphs compiled by the JAX device: ``AsDeclared`` returns its input in the
declared dtype of its output.  Some of PyTensor's JAX implementations return their
accumulator's dtype instead of the variable's (``sum``/``mean``/``prod`` of float32 come back
as float64 when JAX's x64 mode is on), which would change the dtype of outputs and of shared
variables after an update; every output of a compiled function goes through this op, a
no-op when the dtypes agree.  Importing this module registers its JAX implementation."""
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.link.jax.dispatch import jax_funcify


class AsDeclared(Op):
    __props__ = ()
    view_map = {0: [0]}

    def make_node(self, x):
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        outputs[0][0] = inputs[0]

    def infer_shape(self, node, shapes):
        return [shapes[0]]


@jax_funcify.register(AsDeclared)
def _jax_as_declared(op, node=None, **kwargs):
    import jax
    import jax.numpy as jnp
    dtype = node.outputs[0].type.dtype
    if not jax.config.jax_enable_x64:       # (64-bit types are 32-bit there: JAX would warn and narrow)
        dtype = {"float64": "float32", "int64": "int32", "uint64": "uint32",
                 "complex128": "complex64"}.get(dtype, dtype)

    def as_declared(x):
        if getattr(x, "dtype", None) == dtype:
            return x
        return jnp.asarray(x, dtype=dtype)     # also a Python number (a static shape)
    return as_declared


def declared(outputs):
    """``outputs`` (a variable or a list) with every tensor output wrapped."""
    def one(o):
        return AsDeclared()(o) if hasattr(getattr(o, "type", None), "dtype") else o
    if isinstance(outputs, (list, tuple)):
        return [one(o) for o in outputs]
    return one(outputs)
