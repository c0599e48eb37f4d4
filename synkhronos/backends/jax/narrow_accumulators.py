"""Reductions without JAX's x64 mode: accumulate in the width JAX computes in anyway.

PyTensor's sums and products of float32 accumulate in float64 (``acc_dtype``).  With
``floatX=float32`` PyTensor's JAX backend leaves JAX's x64 mode off, so JAX truncates
every 64-bit type to 32 bits and warns each time a graph is traced ("Explicitly requested
dtype float64 requested in astype is not available"): noise a user cannot act on, on every
function, even the introductory example.  The rewrite here (JAX mode, x64 off only) gives
such reductions the 32-bit accumulator JAX uses in their place: the same numbers, no
warning.

PyTensor also types every count and index as int64 (``argmax``, the sum of a boolean,
shapes), which JAX without x64 holds as int32 and warns about again; ``quiet_int64`` keeps
those warnings, raised inside JAX or PyTensor's JAX functions, from the user's screen (a
user's own code asking JAX for a 64-bit type still gets JAX's warning)."""
from pytensor.graph.rewriting.basic import dfs_rewriter, node_rewriter
from pytensor.tensor.elemwise import CAReduce

_NARROW = {"float64": "float32", "int64": "int32", "uint64": "uint32", "complex128": "complex64"}


def _x64():
    import jax
    return bool(jax.config.jax_enable_x64)


@node_rewriter([CAReduce])
def narrow_accumulator(fgraph, node):
    acc = getattr(node.op, "acc_dtype", None)
    if acc not in _NARROW or _x64():
        return None
    out = node.op.clone(acc_dtype=_NARROW[acc])(*node.inputs)
    if out.type.dtype != node.outputs[0].type.dtype:
        return None
    return [out]


def quiet_int64():
    import warnings
    warnings.filterwarnings("ignore", message=r"Explicitly requested dtype u?int64 requested in \w+ is not available",
                            category=UserWarning, module=r"(jax|pytensor|synkhronos)(\.|$)")


def register():
    """Register the rewrite in PyTensor's JAX mode (``conversions.register``: once per process)."""
    quiet_int64()
    from pytensor.compile import optdb
    optdb.register("synk_jax_narrow_accumulators", dfs_rewriter(narrow_accumulator), "jax", position=100)
