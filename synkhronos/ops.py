"""Collectives inside the graph: PyTensor ops that combine values across the ranks of a call.

A ``synk.function`` runs the same compiled graph on every rank, each on its shard.  The ops
here let that graph exchange values between the ranks while it runs, with gradients:

=============================================  ===============================================
``all_reduce(x, op="sum")``                    every rank gets the reduction over ranks (``avg``,
                                               ``sum``, ``prod``, ``max``, ``min``); equal
                                               shapes on every rank
``all_gather(x)``                              every rank gets the concatenation along axis 0,
                                               in rank order; first dimensions may differ
``reduce_scatter(x, op="sum", counts=None)``   rank r gets its block of rows of the reduction:
                                               near-equal blocks, or ``counts[r]`` rows
``broadcast(x, root=0)``                       every rank gets the root's ``x``
``reduce(x, op="sum", root=0)``                the root gets the reduction, the others zeros
                                               (the gradient of ``broadcast``)
``this_rank()``, ``n_ranks()``                 the rank running the graph, and how many there are
=============================================  ===============================================

Every op runs on every rank at the same point of the graph (all ranks run the same graph,
in the same order) and calls the comm plane directly, ``rank.current().comm``: no round trip
through the master.  Outside a distributed call (plain PyTensor, ``Function.as_theano``)
and with one rank, each op acts as a single rank would: the all-reduce, gather, scatter
and broadcast return their input (a view, declared in ``view_map``), ``reduce`` too, and
``this_rank()``/``n_ranks()`` are 0 and 1.

Gradients (the gradient of what every rank's graph computes, summed over ranks, which is
what the updates of a data-parallel function use):

* ``all_reduce(sum)`` <-> ``all_reduce(sum)``; ``avg``: ``all_reduce(avg)`` (sum / n);
  ``max``/``min``: the summed upstream gradient flows to every rank whose value is the
  extreme (ties: each tied rank gets all of it, as PyTensor's ``max``); ``prod``: the
  product of the other ranks' values times the summed upstream gradient (zeros included).
* ``all_gather`` <-> ``reduce_scatter(sum)`` with the per-rank row counts of the forward
  gather, so unequal shards get their own rows back.
* ``broadcast(root)`` <-> ``reduce(sum, root)``: the root gets the sum, the others zero.

Each call uses one of ``RESERVED_KEYS`` comm keys (after the shared variables' keys; the ops
run one after another within a rank, so a key per verb suffices) with fence semantics, and
copies results the comm implementation owns (its buffers serve the next collective on the
key) into arrays of its own; arrays an implementation returns new (``returns_new``) are used
as they are.

Backends: the ops run Python code on the host.  PyTensor's default (numba) backend calls
them from the compiled graph through ``numba.objmode``, registered here with a cache key, so
graphs holding them are cached on disk like any other; the C and Python backends call
``perform``.  A JAX session (GPUs, ``mode="JAX"``) compiles such a graph as one XLA program
with XLA's collectives inside where every rank has its own device and the call's shapes
agree (``backends/jax/one_program``), else as jitted stretches between the ops, which move
device arrays through the device's collectives (``backends/jax/host_ops``).  Other backends
that compile the whole graph into another framework (``mode="JAX"`` in a CPU session,
PyTorch, MLX) cannot call them:
``synk.function`` refuses such a graph when it is made (``check_backend``)."""
import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.gradient import DisconnectedType, grad_not_implemented
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.tensor.type import TensorType, discrete_dtypes, integer_dtypes

from . import rank as _rank
from .reductions import OPS, check_mode

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "this_rank", "n_ranks",
           "RESERVED_KEYS", "CollectiveOp", "AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce",
           "RankInfo", "uses_collectives", "check_backend"]

RESERVED_KEYS = 4
"""Comm keys reserved for in-graph collectives, after those of the shared variables."""

_KEY = {"all_reduce": 0, "reduce": 0, "broadcast": 1, "all_gatherv": 2, "reduce_scatter": 3}
_NUMBA_VERSION = 1         # bump when the numba implementation changes (part of its cache key)
_UNSUPPORTED_LINKERS = ("JAXLinker", "PytorchLinker", "MLXLinker")


def reserved_names(base):
    """``{key: name}`` of the reserved keys after ``base`` shared variables (for messages)."""
    return {base + i: "the input of an in-graph collective (synkhronos.ops)" for i in range(RESERVED_KEYS)}


# ---- runtime -------------------------------------------------------------------------------

def _acting():
    """The rank this process acts as inside a distributed call, or None (a single rank)."""
    r = _rank.current()
    return None if r is None or r.n == 1 else r


def _impl(r, verb, x, op=None):
    """The comm implementation for ``x``: host arrays go to the host's, device arrays (a
    graph compiled by PyTensor's JAX backend) to the device's."""
    placement = "host" if isinstance(x, np.ndarray) else r.device.placement
    return r.comm.pick(verb, x.dtype, op, placement)


def _key(r, verb):
    return len(r.shareds) + _KEY[verb]


def _own(impl, verb, res):
    """``res`` as an array of the caller's own (the comm's buffers serve its next call)."""
    if verb in getattr(impl, "returns_new", ()) or not isinstance(res, np.ndarray):
        return res               # (device arrays are never buffers a comm reuses)
    return np.array(res, copy=True)


def _check_root(root, r):
    if r is not None and not 0 <= root < r.n:
        raise ValueError(f"collective root {root} is out of range for {r.n} rank(s)")


# ---- ops -------------------------------------------------------------------------------------

class CollectiveOp(Op):
    """Base of the in-graph collectives: never constant-folded (the value depends on the
    ranks of the call), output possibly a view of input 0 (with one rank)."""

    __props__ = ()
    view_map = {0: [0]}
    runs_on_host = True          # backends that compile whole graphs run it between compiled parts

    def do_constant_folding(self, fgraph, node):
        return False

    def perform(self, node, inputs, output_storage):
        output_storage[0][0] = self.compute(*inputs)

    def compute(self, *inputs):
        raise NotImplementedError

    def _spec(self):
        """``(kind, op, root)``: what the numba implementation passes back to Python."""
        return (type(self).__name__, getattr(self, "op", ""), int(getattr(self, "root", -1)))


def _float_zeros(x):
    return x.zeros_like(dtype=pytensor.config.floatX)


def _discrete(x):
    return x.type.dtype in discrete_dtypes


def _mask(x, y, g):
    """Where ``x`` equals the extreme ``y``, as ``g``'s dtype."""
    return pt.cast(pt.eq(x, y), g.dtype)


def _tensor(x, what):
    x = pt.as_tensor_variable(x)
    if not isinstance(x.type, TensorType):
        raise TypeError(f"{what} takes a tensor, got {x.type}")
    return x


class AllReduce(CollectiveOp):
    """Every rank gets the reduction over ranks of ``x`` (same shape on every rank)."""

    __props__ = ("op",)

    def __init__(self, op="sum"):
        self.op = check_mode(op, OPS, "all_reduce op")

    def make_node(self, x):
        x = _tensor(x, "all_reduce")
        return Apply(self, [x], [x.type()])

    def compute(self, x):
        r = _acting()
        if r is None:
            return x
        impl = _impl(r, "all_reduce", x, self.op)
        return impl.all_reduce([(_key(r, "all_reduce"), x)], self.op, fence=True, scratch=True, owned=True)[0]

    def infer_shape(self, *args):      # (node, shapes); PyTensor < 3.x: (fgraph, node, shapes)
        return [args[-1][0]]

    def pullback(self, inputs, outputs, grads):
        (x,), (y,), (g,) = inputs, outputs, grads
        if _discrete(x):
            return [_float_zeros(x)]
        if self.op in ("sum", "avg"):
            return [all_reduce(g, self.op)]
        total = all_reduce(g, "sum")               # every rank's output depends on x
        if self.op in ("max", "min"):
            return [total * _mask(x, y, g)]
        stacked = all_gather(pt.shape_padleft(x))  # prod: the others' product, zeros included
        gs = pytensor.grad(None, stacked, known_grads={pt.prod(stacked, axis=0): total})
        return [gs[this_rank()]]


class AllGather(CollectiveOp):
    """Every rank gets every rank's ``x`` concatenated along axis 0, in rank order."""

    def make_node(self, x):
        x = _tensor(x, "all_gather")
        if x.type.ndim == 0:
            raise TypeError("all_gather concatenates along axis 0 and needs at least 1 dimension "
                            "(all_gather(x[None]) stacks scalars)")
        out = TensorType(x.type.dtype, shape=(None,) + tuple(x.type.shape[1:]))()
        return Apply(self, [x], [out])

    def compute(self, x):
        r = _acting()
        if r is None:
            return x
        impl = _impl(r, "all_gatherv", x)
        return _own(impl, "all_gatherv", impl.all_gatherv([(_key(r, "all_gatherv"), x)], fence=True)[0])

    def pullback(self, inputs, outputs, grads):
        (x,), (g,) = inputs, grads
        if _discrete(x):
            return [_float_zeros(x)]
        counts = all_gather(pt.shape(x)[:1])       # every rank's rows in the forward gather
        return [reduce_scatter(g, "sum", counts=counts)]


class ReduceScatter(CollectiveOp):
    """Rank r gets its block of rows (axis 0) of the reduction over ranks of ``x``: rows
    ``[r * N // n, (r + 1) * N // n)``, or ``counts[r]`` rows after ``sum(counts[:r])``."""

    __props__ = ("op",)

    def __init__(self, op="sum"):
        self.op = check_mode(op, OPS, "reduce_scatter op")

    def make_node(self, x, counts=None):
        x = _tensor(x, "reduce_scatter")
        if x.type.ndim == 0:
            raise TypeError("reduce_scatter splits along axis 0 and needs at least 1 dimension")
        inputs = [x]
        if counts is not None:
            counts = pt.as_tensor_variable(counts)
            if counts.type.ndim != 1 or counts.type.dtype not in integer_dtypes:
                raise TypeError(f"reduce_scatter counts must be a vector of integers (rows per rank), "
                                f"got {counts.type}")
            inputs.append(pt.cast(counts, "int64"))
        out = TensorType(x.type.dtype, shape=(None,) + tuple(x.type.shape[1:]))()
        return Apply(self, inputs, [out])

    def compute(self, x, counts=None):
        r = _acting()
        if counts is not None:
            counts = tuple(int(c) for c in counts)
        if r is None:
            if counts is not None and counts != (x.shape[0],):
                raise ValueError(f"reduce_scatter counts {list(counts)} do not fit one rank holding "
                                 f"{x.shape[0]} rows")
            return x
        impl = _impl(r, "reduce_scatter", x, self.op)
        res = impl.reduce_scatter([(_key(r, "reduce_scatter"), x)], self.op, fence=True,
                                  counts=None if counts is None else [counts], scratch=True)[0]
        return _own(impl, "reduce_scatter", res)

    def connection_pattern(self, node):
        return [[True]] + [[False]] * (len(node.inputs) - 1)

    def pullback(self, inputs, outputs, grads):
        x, (y,), (g,) = inputs[0], outputs, grads
        rest = [DisconnectedType()() for _ in inputs[1:]]
        if _discrete(x):
            return [_float_zeros(x)] + rest
        if self.op == "sum":
            gx = all_gather(g)
        elif self.op == "avg":
            gx = all_gather(g) / pt.cast(n_ranks(), g.dtype)
        elif self.op in ("max", "min"):
            gx = all_gather(g) * _mask(x, all_gather(y), g)
        else:
            return [grad_not_implemented(self, 0, x, "reduce_scatter(prod) has no gradient")] + rest
        return [gx] + rest


class Broadcast(CollectiveOp):
    """Every rank gets the root's ``x``."""

    __props__ = ("root",)

    def __init__(self, root=0):
        self.root = _root(root)

    def make_node(self, x):
        x = _tensor(x, "broadcast")
        return Apply(self, [x], [x.type()])

    def compute(self, x):
        r = _acting()
        _check_root(self.root, _rank.current())
        if r is None:
            return x
        impl = _impl(r, "broadcast", x)
        return _own(impl, "broadcast", impl.broadcast([(_key(r, "broadcast"), x, x.dtype)], self.root,
                                                      fence=True)[0])

    def pullback(self, inputs, outputs, grads):
        (x,), (g,) = inputs, grads
        if _discrete(x):
            return [_float_zeros(x)]
        return [reduce(g, "sum", self.root, like=x)]


class Reduce(CollectiveOp):
    """The root gets the reduction over ranks of ``x``; the other ranks get zeros shaped like
    ``like`` (their ``x`` by default)."""

    __props__ = ("op", "root")

    def __init__(self, op="sum", root=0):
        self.op = check_mode(op, OPS, "reduce op")
        self.root = _root(root)

    def make_node(self, x, like=None):
        x = _tensor(x, "reduce")
        like = x if like is None else _tensor(like, "reduce")
        if like.type.ndim != x.type.ndim:
            raise TypeError(f"reduce: like has {like.type.ndim} dimensions, x has {x.type.ndim}")
        return Apply(self, [x, like], [x.type()])

    def compute(self, x, like):
        r = _acting()
        _check_root(self.root, _rank.current())
        if r is None:
            return x
        impl = _impl(r, "reduce", x, self.op)
        res = impl.reduce([(_key(r, "reduce"), x)], self.op, self.root, fence=True)
        if r.rank != self.root:
            return np.zeros(like.shape, x.dtype)
        return _own(impl, "reduce", res[0])

    def infer_shape(self, *args):      # (node, shapes); PyTensor < 3.x: (fgraph, node, shapes)
        return [args[-1][1]]

    def connection_pattern(self, node):
        return [[True], [False]]

    def pullback(self, inputs, outputs, grads):
        (x, _), (y,), (g,) = inputs, outputs, grads
        rest = [DisconnectedType()()]
        if _discrete(x):
            return [_float_zeros(x)] + rest
        if self.op == "sum":
            gx = broadcast(g, self.root)
        elif self.op == "avg":
            gx = broadcast(g, self.root) / pt.cast(n_ranks(), g.dtype)
        elif self.op in ("max", "min"):
            gx = broadcast(g, self.root) * _mask(x, broadcast(y, self.root), g)
        else:
            return [grad_not_implemented(self, 0, x, "reduce(prod) has no gradient")] + rest
        return [gx] + rest


class RankInfo(CollectiveOp):
    """``this_rank()`` (``what="rank"``) or ``n_ranks()`` (``what="size"``) as an int64 scalar."""

    __props__ = ("what",)
    view_map = {}
    static_value = True          # the same at every call of a rank: compiled backends may inline it

    def __init__(self, what):
        if what not in ("rank", "size"):
            raise ValueError(f"RankInfo what must be 'rank' or 'size', got {what!r}")
        self.what = what

    def make_node(self):
        return Apply(self, [], [pt.lscalar()])

    def compute(self):
        r = _rank.current()
        if self.what == "rank":
            return np.asarray(0 if r is None else r.rank, np.int64)
        return np.asarray(1 if r is None else r.n, np.int64)

    def infer_shape(self, *args):
        return [()]

    def pullback(self, inputs, outputs, grads):
        return []

    def _spec(self):
        return (type(self).__name__, self.what, -1)


if not hasattr(Op, "pullback"):      # PyTensor releases before pullback: the same as L_op
    for _cls in (AllReduce, AllGather, ReduceScatter, Broadcast, Reduce, RankInfo):
        _cls.L_op = _cls.pullback


def _root(root):
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or root < 0:
        raise ValueError(f"collective root must be a rank (an int >= 0), got {root!r}")
    return int(root)


# ---- what users call ---------------------------------------------------------------------------

def all_reduce(x, op="sum"):
    """Every rank gets the reduction over ranks of ``x`` (``avg``, ``sum``, ``prod``, ``max``,
    ``min``; ``x`` must have the same shape on every rank)."""
    return AllReduce(op)(x)


def all_gather(x):
    """Every rank gets all ranks' ``x`` concatenated along axis 0 in rank order (the first
    dimension may differ between ranks; the others may not)."""
    return AllGather()(x)


def reduce_scatter(x, op="sum", counts=None):
    """Rank r gets its block of rows of the reduction over ranks of ``x`` (same shape on
    every rank): near-equal blocks (rows ``r*N//n`` to ``(r+1)*N//n``, as ``synk.function``
    splits its inputs) or, with ``counts`` (one int per rank, the same on every rank; a
    sequence or a symbolic int vector), ``counts[r]`` rows after ``sum(counts[:r])``."""
    if counts is not None and not hasattr(counts, "type"):
        counts = np.asarray(counts, dtype=np.int64)
    return ReduceScatter(op)(x) if counts is None else ReduceScatter(op)(x, counts)


def broadcast(x, root=0):
    """Every rank gets rank ``root``'s ``x`` (its shape on the root decides)."""
    return Broadcast(root)(x)


def reduce(x, op="sum", root=0, like=None):
    """Rank ``root`` gets the reduction over ranks of ``x``; every other rank gets zeros
    shaped like ``like`` (default: its own ``x``).  The gradient of ``broadcast``."""
    return Reduce(op, root)(x, like)


def this_rank():
    """The rank running the graph (an int64 scalar; 0 outside a distributed call)."""
    return RankInfo("rank")()


def n_ranks():
    """The number of ranks running the graph (an int64 scalar; 1 outside a distributed call)."""
    return RankInfo("size")()


# ---- checks for synk.function ------------------------------------------------------------------

def _collectives(outputs, inner=False):
    """For each in-graph collective of the graph of ``outputs``: whether it lies inside an
    inner graph (a ``scan`` step, an ``OpFromGraph``)."""
    from pytensor.graph.op import HasMultipleInnerGraph
    from pytensor.graph.traversal import ancestors
    seen = set()
    for v in ancestors([o for o in outputs if o is not None]):
        node = v.owner
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node.op, CollectiveOp):
            yield inner
        elif isinstance(node.op, HasMultipleInnerGraph):
            for g in node.op.inner_graphs.values():
                yield from _collectives(g.outputs, True)


def uses_collectives(outputs):
    """Whether the graph of ``outputs`` (variables) holds an in-graph collective, inner
    graphs included: such a call runs on every rank at once (never the master's share
    first), however deep its collectives lie."""
    return any(True for _ in _collectives(outputs))


def in_inner_graphs(outputs):
    """Whether an in-graph collective of the graph of ``outputs`` lies in an inner graph."""
    return any(_collectives(outputs))


def check_backend(mode, device=None, inner=False):
    """TypeError, saying why, when in-graph collectives cannot run under ``mode`` (a PyTensor
    mode or its name) or on ``device``; ``inner``: some lie inside an inner graph."""
    from pytensor.compile.mode import get_mode
    if getattr(device, "runs_host_ops", False):
        if inner:
            raise TypeError("this graph holds synkhronos.ops collectives inside a scan (or another inner "
                            f"graph); this session's device ({getattr(device, 'kind', '?')}) compiles graphs "
                            "with PyTensor's JAX backend, which runs collectives only in the outer graph. "
                            "Unroll the loop, or use a CPU session (the default mode).")
        return                   # the device compiles such graphs itself (JAX: one program or stretches)
    linker = type(get_mode(mode).linker).__name__
    if linker in _UNSUPPORTED_LINKERS:
        raise TypeError(f"this graph holds synkhronos.ops collectives, which call the comm plane from "
                        f"Python on the host; mode {mode!r} ({linker}) compiles the whole graph into "
                        "another framework, which cannot call them. Use PyTensor's default mode "
                        "(numba) or a C/Python mode, or move the collective out of the graph "
                        "(synk.all_reduce etc. on shared variables between calls).")
    placement = getattr(device, "placement", "host")
    if placement != "host":
        raise TypeError(f"this graph holds synkhronos.ops collectives, which call the comm plane from "
                        f"Python on the host; this session's device ({getattr(device, 'kind', '?')}) keeps "
                        f"arrays on {placement!r} and compiles whole graphs (PyTensor's JAX backend), which "
                        "cannot call them. Use a CPU session (the default mode), or move the collective "
                        "out of the graph (synk.all_reduce etc. on shared variables between calls).")


# ---- numba: call back into Python through objmode, with a cache key ----------------------------

_SPEC_OPS = {}


def _from_spec(kind, a, b):
    op = _SPEC_OPS.get((kind, a, b))
    if op is None:
        cls = {c.__name__: c for c in (AllReduce, AllGather, ReduceScatter, Broadcast, Reduce, RankInfo)}[kind]
        if cls is AllGather:
            op = cls()
        elif cls is Broadcast:
            op = cls(b)
        elif cls is Reduce:
            op = cls(a, b)
        else:
            op = cls(a)
        _SPEC_OPS[(kind, a, b)] = op
    return op


def _numba_perform(kind, a, b, *inputs):
    """What the compiled graph calls (in object mode) for one collective."""
    return _from_spec(kind, a, b).compute(*inputs)


def _register_numba():
    try:
        import numba
        from pytensor.link.numba.dispatch.basic import (get_numba_type, numba_njit,
                                                        register_funcify_default_op_cache_key)
    except ImportError:          # no numba: the C and Python backends use perform
        return

    @register_funcify_default_op_cache_key(CollectiveOp)
    def numba_funcify_collective(op, node, **kwargs):
        ret_t = get_numba_type(node.outputs[0].type)
        kind, a, b = op._spec()
        n_in = len(node.inputs)
        if n_in == 0:
            def collective():
                with numba.objmode(ret=ret_t):
                    ret = _numba_perform(kind, a, b)
                return ret
        elif n_in == 1:
            def collective(x):
                with numba.objmode(ret=ret_t):
                    ret = _numba_perform(kind, a, b, x)
                return ret
        else:
            def collective(x, y):
                with numba.objmode(ret=ret_t):
                    ret = _numba_perform(kind, a, b, x, y)
                return ret
        return numba_njit(collective), _NUMBA_VERSION


_register_numba()
