"""Graphs holding in-graph collectives as one XLA program, where every rank has its own
device and XLA's collectives serve the session (NCCL between GPUs; gloo between JAX CPU
ranks with ``SYNK_JAX_COMM=xla``).

``host_ops`` runs such a graph as jitted stretches with the collectives between them (each
an XLA collective program of its own, or the host's path).  Here the whole graph is one
``jax.jit`` of a ``shard_map`` over the ranks' mesh instead: each rank's inputs are its
blocks of global arrays (a leading axis of length 1), each ``synkhronos.ops`` collective is
XLA's own inside the program (``psum``/``pmax``/``pmin``, ``all_gather``, a bit-exact
broadcast; ``this_rank()`` is the mesh index), and each rank gets its own outputs back.
No stretch boundaries, no dispatch or host round trip per collective.

XLA needs the same program on every rank, with the same shapes: before each call the ranks
exchange their inputs' shapes through the host (as every XLA collective here does: a
mismatch would hang XLA).  A call whose shapes differ between ranks (an uneven last
shard), and a graph that cannot be one program for every rank (a slice bounded by
``this_rank()``, a ``reduce_scatter`` into unequal blocks, a dtype XLA's collectives do not
take, a random generator among the inputs), runs as stretches; every rank decides alike
(the same graph, the same shapes).  The program runs with the control plane's liveness
checks (``XlaComm.execute``): a rank that fails or dies ends the call on every rank with
the usual errors, never a hang."""
import numpy as np
from pytensor.graph.basic import Constant
from pytensor.scalar import Cast
from pytensor.tensor.elemwise import Elemwise
from pytensor.tensor.shape import Shape, Shape_i
from pytensor.tensor.type import TensorType

from .xla_comm import broadcasted, over_ranks, reduced, serves
from ... import ops as synk_ops
from ... import rank as _rank
from ...signals import deferred


class NotOneProgram(Exception):
    """The graph cannot run as one program for every rank (with these shapes)."""


class OneProgram:
    """Runs a graph as one XLA program over the ranks where it can, else as ``stretches``."""

    def __init__(self, fgraph, stretches, convert_kwargs=None):
        self.fgraph = fgraph
        self.stretches = stretches
        self.kwargs = dict(convert_kwargs or {})
        self.possible = all(isinstance(v.type, TensorType) for v in fgraph.inputs)
        self.programs = {}          # (n, signature) -> compiled program, or None (stretches)
        # each rank's block of a global array along axis 0: an array's own first axis, a
        # new one for scalars
        self.scalar_out = [getattr(v.type, "ndim", 0) == 0 for v in fgraph.outputs]

    def __call__(self, *args):
        r = _rank.current()
        xla = r.comm.find("xla") if self.possible and r is not None and r.n > 1 else None
        if xla is not None:
            with deferred():        # (as XLA's collectives: xla_comm.uninterrupted)
                program = self._agreed(xla, r.n, args)
                if program is not None:
                    r.comm.record("in-graph program", sum(int(getattr(a, "nbytes", 0)) for a in args), via="xla")
                    outs = xla.execute(program, [xla.shard(a, np.ndim(a) == 0) for a in args])
                    return [o.addressable_data(0).reshape(()) if scalar else o.addressable_data(0)
                            for o, scalar in zip(outs, self.scalar_out)]
        return self.stretches(*args)

    def _agreed(self, xla, n, args):
        """The program every rank runs for these inputs, or None (stretches): the ranks
        meet on their shapes (every call), and on whether they compiled it (once)."""
        per, usable = xla.meet([tuple(np.shape(a)) for a in args])
        if not usable or any(len(set(s)) > 1 for s in per):
            return None
        key = (n, tuple((tuple(np.shape(a)), str(getattr(a, "dtype", type(a).__name__))) for a in args))
        if key not in self.programs:
            program = self._compiled(xla, n, args)
            every = xla.shapes([(int(program is not None),)])[0]   # (one rank's failure: none uses it)
            self.programs[key] = program if all(s == (1,) for s in every) else None
        return self.programs[key]

    def _compiled(self, xla, n, args):
        """The compiled program for these inputs, or None when the graph cannot be one
        (inside the caller's signal window: an interrupt never shows as a failed trace)."""
        import jax
        try:
            fn = self._function(n)
            n_out = len(self.fgraph.outputs)

            scalar_in = [np.ndim(a) == 0 for a in args]

            def body(*xs):
                import jax.numpy as jnp
                outs = fn(*[x[0] if s else x for x, s in zip(xs, scalar_in)])
                return tuple(jnp.asarray(o)[None] if s else jnp.asarray(o) for o, s in zip(outs, self.scalar_out))
            mapped = over_ranks(body, xla.mesh()[0], len(args), n_out, sharded_out=True)
            return jax.jit(mapped).lower(*[xla.shard(a, s) for a, s in zip(args, scalar_in)]).compile()
        except Exception:            # noqa: BLE001 - e.g. a slice bounded by this_rank(): stretches
            return None

    def _function(self, n):
        from pytensor.link.jax.dispatch import jax_funcify, jax_typify
        from pytensor.link.utils import fgraph_to_python

        def convert(op, node=None, **kwargs):
            if isinstance(op, synk_ops.CollectiveOp):
                return lowered(op, node, n)
            return jax_funcify(op, node=node, **kwargs)
        return fgraph_to_python(self.fgraph, convert, type_conversion_fn=jax_typify,
                                fgraph_name="synk_one_program", **self.kwargs)


def lowered(op, node, n):
    """The JAX function of collective ``op`` inside a program over the ranks' mesh (axis
    ``"r"``, ``n`` ranks; every rank's shapes are equal, as the call checked)."""
    import jax
    import jax.numpy as jnp
    dtype = node.outputs[0].type.dtype
    if isinstance(op, synk_ops.RankInfo):
        if op.what == "size":
            return lambda: np.asarray(n, np.int64)
        int64 = jax.dtypes.canonicalize_dtype(np.int64)     # (int32 without JAX's x64 mode)
        return lambda: jax.lax.axis_index("r").astype(int64)
    if not serves(dtype, getattr(op, "op", None)):
        raise NotOneProgram(f"XLA's collectives do not take {dtype}")
    if isinstance(op, synk_ops.AllReduce):
        return lambda x: reduced(x, op.op, n)
    if getattr(op, "root", 0) >= n:
        raise NotOneProgram("a root out of range")        # (the stretches say so)
    if isinstance(op, synk_ops.Broadcast):
        return lambda x: broadcasted(x, op.root)
    if isinstance(op, synk_ops.AllGather):
        def all_gather(x):
            if not isinstance(x, jax.core.Tracer):       # known when tracing: the same on every rank
                return np.concatenate([np.asarray(x)] * n, axis=0)
            return jax.lax.all_gather(x, "r", tiled=True)
        return all_gather
    if isinstance(op, synk_ops.ReduceScatter):
        gathered_alike = len(node.inputs) > 1 and _gathered_alike(node.inputs[1])

        def reduce_scatter(x, counts=None):
            rows = x.shape[0]
            if counts is not None and isinstance(counts, jax.core.Tracer):
                if not gathered_alike:
                    raise NotOneProgram("reduce_scatter counts known only when the program runs")
                counts = None                   # (every rank's count is the same: equal blocks)
            if counts is not None:
                counts = [int(c) for c in np.asarray(counts)]
                if len(counts) != n or sum(counts) != rows:
                    raise NotOneProgram("reduce_scatter counts do not fit the rows")
            else:
                counts = [(r + 1) * rows // n - r * rows // n for r in range(n)]
            if len(set(counts)) > 1:
                raise NotOneProgram("reduce_scatter into unequal blocks")
            k = counts[0]
            y = reduced(x, op.op, n)
            return jax.lax.dynamic_slice_in_dim(y, jax.lax.axis_index("r") * k, k, axis=0)
        return reduce_scatter
    if isinstance(op, synk_ops.Reduce):
        def reduce(x, like):
            if tuple(np.shape(like)) != tuple(x.shape):
                raise NotOneProgram("reduce with a differently shaped like")
            y = reduced(x, op.op, n)
            return jnp.where(jax.lax.axis_index("r") == op.root, y, jnp.zeros_like(y))
        return reduce
    raise NotOneProgram(f"no lowering of {type(op).__name__}")


def _gathered_alike(counts):
    """Whether ``counts`` is an ``all_gather`` of a value that is the same on every rank (a
    row count read from a shape, as the gradient of ``all_gather`` makes): every count is
    then the same, whatever their values."""
    v = counts
    while v.owner is not None and isinstance(v.owner.op, Elemwise) and isinstance(v.owner.op.scalar_op, Cast):
        v = v.owner.inputs[0]
    return v.owner is not None and isinstance(v.owner.op, synk_ops.AllGather) and _alike(v.owner.inputs[0])


def _alike(v, depth=0):
    """Whether ``v`` is the same on every rank of a call whose inputs have the same shapes on
    every rank: it reads shapes, constants, ``n_ranks()`` and values that collectives made
    the same, never an input's values or ``this_rank()``."""
    if isinstance(v, Constant):
        return True
    node = v.owner
    if node is None or depth > 64:
        return False
    op = node.op
    if isinstance(op, (Shape, Shape_i)):
        return True
    if isinstance(op, synk_ops.RankInfo):
        return op.what == "size"
    if isinstance(op, (synk_ops.AllReduce, synk_ops.Broadcast, synk_ops.AllGather)):
        return True
    if isinstance(op, synk_ops.CollectiveOp):
        return False
    return all(_alike(i, depth + 1) for i in node.inputs)
