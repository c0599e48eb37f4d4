"""Integer arithmetic on array shapes, kept static for PyTensor's JAX backend.

JAX compiles a graph once per input shape, and every shape is known then; but PyTensor's
JAX backend turns arithmetic on shapes (``x.shape[0] * 2 // 3``) into traced JAX values,
which JAX refuses wherever it needs a static number: a slice bound, an ``arange`` bound,
a size.  Such graphs are common after PyTensor's shape inference, which replaces
``shape[axis]`` of a reshaped array by the reshape's size arithmetic (pytensor-ml's max
pooling: the tap count of a window reshaped from its spatial taps; the batch rows of a
flattened feature map in a slice).

The rewrite here (JAX mode only, outermost expressions first) replaces each such integer
expression by a ``ShapeArith`` op: its inputs are the arrays whose shapes the expression
reads, and it carries the arithmetic as a small program over those shapes, which its JAX
implementation evaluates in Python from the shapes JAX knows while tracing.  An ``arange``
over such bounds becomes one ``ShapeArith`` too (PyTensor's conversion of ``arange``
accepts constant or single-length bounds only).

PyTensor's broadcasting of shapes it does not know carries runtime checks (``Assert`` ops
on the lengths); JAX checks broadcasting itself while it traces and drops every ``Assert``
with a warning the user cannot act on, and the checks stand between a length and its use.
They are removed first (``drop_broadcast_checks``)."""
import numpy as np
from pytensor.graph.basic import Apply, Constant
from pytensor.graph.op import Op
from pytensor.graph.rewriting.basic import node_rewriter, out2in
from pytensor.raise_op import Assert
from pytensor.scalar import ScalarOp, ScalarType
from pytensor.tensor.basic import ARange, ScalarFromTensor, TensorFromScalar
from pytensor.tensor.elemwise import Elemwise
from pytensor.tensor.shape import Shape, Shape_i
from pytensor.tensor.subtensor import Subtensor
from pytensor.tensor.type import TensorType

_MAX_STEPS = 64          # shape expressions are short; a longer one is left alone


class ShapeArith(Op):
    """An integer: a 0-d tensor (``kind="scalar"``) or a PyTensor scalar (``"pyscalar"``, as
    slice bounds are), or ``arange(start, stop, step)`` (``"arange"``)
    computed by ``program`` from the shapes of the op's inputs.  ``program``: steps ``("c",
    value)`` (a constant), ``("s", input, axis)`` (a length), ``("v", input)`` (the value of
    an input that is a static integer: the output of an op whose class says ``static_value``)
    or ``("f", scalar_op, (step, ...))`` (a scalar op on earlier steps); ``results``: the
    steps holding the value (one) or the bounds (three)."""

    __props__ = ("kind", "dtype", "program", "results")

    def __init__(self, kind, dtype, program, results):
        if kind not in ("scalar", "pyscalar", "arange"):
            raise ValueError(f"ShapeArith kind must be 'scalar', 'pyscalar' or 'arange', got {kind!r}")
        self.kind, self.dtype = kind, str(dtype)
        self.program, self.results = tuple(program), tuple(results)

    def make_node(self, *sources):
        if self.kind == "pyscalar":
            out = ScalarType(self.dtype)()
        else:
            out = TensorType(self.dtype, shape=() if self.kind == "scalar" else (None,))()
        return Apply(self, list(sources), [out])

    def evaluate(self, sources):
        """The results as Python ints, from the inputs (their shapes, or static values)."""
        vals = []
        for step in self.program:
            if step[0] == "c":
                vals.append(step[1])
            elif step[0] == "s":
                vals.append(np.int64(np.shape(sources[step[1]])[step[2]]))
            elif step[0] == "v":
                vals.append(np.int64(int(sources[step[1]])))
            else:
                vals.append(step[1].impl(*[vals[i] for i in step[2]]))
        return [int(vals[i]) for i in self.results]

    def compute(self, sources, xp=np):
        values = self.evaluate(sources)
        if self.kind == "scalar":
            return np.asarray(values[0], self.dtype)
        if self.kind == "pyscalar":
            return np.dtype(self.dtype).type(values[0])
        return xp.arange(*values, dtype=self.dtype)

    def perform(self, node, inputs, outputs):
        outputs[0][0] = self.compute(inputs)

    def connection_pattern(self, node):
        return [[False] for _ in node.inputs]

    def pullback(self, inputs, outputs, grads):
        from pytensor.gradient import DisconnectedType
        return [DisconnectedType()() for _ in inputs]


def _program(values):
    """``(program, results, sources)`` computing ``values`` (integer scalar variables) from
    shapes, or None when one of them is not integer arithmetic on shapes and constants."""
    program, index, sources = [], {}, []

    def source(v):
        for i, s in enumerate(sources):
            if s is v:
                return i
        sources.append(v)
        return len(sources) - 1

    def visit(v):
        if v in index:
            return index[v]
        if len(program) > _MAX_STEPS:
            return None
        node = v.owner
        if isinstance(v, Constant):
            data = np.asarray(v.data)
            if data.size != 1 or data.dtype.kind not in "iub":
                return None
            step = ("c", data.reshape(()).item())
        elif node is None:
            return None
        elif isinstance(node.op, Shape_i):
            step = ("s", source(node.inputs[0]), node.op.i)
        elif getattr(node.op, "static_value", False) and _int_scalar(v):
            step = ("v", source(v))
        elif isinstance(node.op, ShapeArith) and node.op.kind != "arange":
            inner = [source(i) for i in node.inputs]      # its program, over our sources
            offset = len(program)
            for st in node.op.program:
                if st[0] in ("s", "v"):
                    program.append((st[0], inner[st[1]]) + tuple(st[2:]))
                elif st[0] == "f":
                    program.append(("f", st[1], tuple(i + offset for i in st[2])))
                else:
                    program.append(st)
            index[v] = offset + node.op.results[0]
            return index[v]
        elif (isinstance(node.op, Subtensor) and node.inputs[0].owner is not None
              and isinstance(node.inputs[0].owner.op, Shape) and len(node.inputs) == 2
              and isinstance(node.inputs[1], Constant) and v.type.ndim == 0):
            step = ("s", source(node.inputs[0].owner.inputs[0]), int(node.inputs[1].data))
        elif isinstance(node.op, (ScalarFromTensor, TensorFromScalar)):
            return visit(node.inputs[0])
        elif isinstance(node.op, (Elemwise, ScalarOp)) and _int_scalar(v):
            args = [visit(i) for i in node.inputs]
            if any(a is None for a in args):
                return None
            step = ("f", getattr(node.op, "scalar_op", node.op), tuple(args))
        else:
            return None
        program.append(step)
        index[v] = len(program) - 1
        return index[v]

    results = [visit(v) for v in values]
    if any(r is None for r in results) or not sources:
        return None
    return program, results, sources


def _int_scalar(v):
    """An integer (or boolean) 0-d tensor or PyTensor scalar."""
    return getattr(v.type, "ndim", 0) == 0 and str(getattr(v.type, "dtype", ""))[:3] in ("int", "uin", "boo")


def _has_source(node):
    """Whether an arithmetic node reads a shape (pure constants are folded by PyTensor)."""
    return not all(isinstance(i, Constant) for i in node.inputs)


def _native(v):
    """Bounds PyTensor's JAX conversion of ``arange`` accepts as they are."""
    return isinstance(v, Constant) or (v.owner is not None and isinstance(v.owner.op, Shape_i))


@node_rewriter([Elemwise, ScalarOp, ScalarFromTensor, ARange])
def static_shapes(fgraph, node):
    """Integer arithmetic on shapes (and ``arange`` over it) made one ``ShapeArith``."""
    if isinstance(node.op, ARange):
        if all(_native(b) for b in node.inputs):
            return None
        found = _program(node.inputs)
        kind = "arange"
    else:
        out = node.outputs[0]
        if not _int_scalar(out) or not (isinstance(node.op, ScalarFromTensor) or _has_source(node)):
            return None
        found = _program([out])
        kind = "scalar" if isinstance(out.type, TensorType) else "pyscalar"
    if found is None:
        return None
    program, results, sources = found
    return [ShapeArith(kind, node.outputs[0].type.dtype, program, results)(*sources)]


_BROADCAST_CHECKS = ("Could not broadcast dimensions",)


@node_rewriter([Assert])
def drop_broadcast_checks(fgraph, node):
    """PyTensor's runtime check of a broadcast length, which JAX makes itself."""
    if str(getattr(node.op, "msg", "")).startswith(_BROADCAST_CHECKS):
        return [node.inputs[0]]
    return None


def _jax_shape_arith(op, node=None, **kwargs):
    def shape_arith(*sources):
        import jax.numpy as jnp
        return op.compute(sources, xp=jnp)
    return shape_arith


def register():
    """Register the rewrites (in PyTensor's JAX mode) and the op's JAX implementation
    (``conversions.register``: once per process)."""
    from pytensor.compile import optdb
    from pytensor.link.jax.dispatch import jax_funcify
    jax_funcify.register(ShapeArith)(_jax_shape_arith)
    optdb.register("synk_jax_drop_broadcast_checks", out2in(drop_broadcast_checks), "jax", position=99.9)
    optdb.register("synk_jax_static_shapes", out2in(static_shapes), "jax", position=100)
