"""Graphs holding ops that run on the host, compiled by PyTensor's JAX backend.

An in-graph collective (``synkhronos.ops``) calls the comm plane from Python while the
graph runs; a graph that JAX compiles whole (one ``jax.jit``) cannot call it.  A graph
holding such ops (their class says ``runs_on_host = True``; they compute with
``op.compute(*values)``) is compiled here as *stretches*: every other node is placed in the
earliest stretch its inputs allow, each stretch is one ``jax.jit`` (compiled once per input
shape, as any JAX function), and the host ops run between stretches, in the same order on
every rank.  Their values stay JAX arrays: the comm plane moves device arrays itself (XLA's
collectives where it can, through the host where it must), and a host result (a NumPy
array) goes to the device once, explicitly.  On JAX's CPU device the host ops get NumPy
views of the arrays and use the host's collectives directly.  Where XLA's collectives
serve the session, a call whose shapes agree on every rank runs the graph as one XLA
program instead (``one_program``; the stretches serve the other calls).

A host op whose output is a small integer fixed for the rank (``static_value = True``:
``this_rank()``, ``n_ranks()``) enters the next stretches as a static argument, so that a
slice or a size computed from it is a number JAX knows when it compiles (see
``static_shapes``, which reads such outputs as it reads shapes)."""
import numpy as np
from pytensor.graph.basic import Constant
from pytensor.graph.fg import FunctionGraph
from pytensor.link.jax.linker import JAXLinker

from .held import Held
from .transfers import to_device


def runs_on_host(node):
    return bool(getattr(node.op, "runs_on_host", False))


def holds_host_ops(fgraph_or_outputs):
    """Whether a graph (a FunctionGraph or a list of output variables) holds a host op."""
    from pytensor.graph.traversal import applys_between
    if isinstance(fgraph_or_outputs, FunctionGraph):
        nodes = fgraph_or_outputs.apply_nodes
    else:
        nodes = applys_between([], [o for o in fgraph_or_outputs if o is not None])
    return any(runs_on_host(n) for n in nodes)


_eager_registered = set()


def _eager(op, node=None, **kwargs):
    """The plain JAX conversion of a host op (used outside the stretches only: where no
    distributed call runs, the op acts as a single rank would)."""
    return op.compute


def stretched(mode):
    """``mode`` (a JAX mode or its name) with the linker of this module."""
    from pytensor.compile.mode import Mode, get_mode
    return Mode(linker=StretchedJAXLinker(), optimizer=get_mode(mode).provided_optimizer)


class StretchedJAXLinker(JAXLinker):
    """PyTensor's JAX linker, for graphs that hold host ops: one ``jax.jit`` per stretch
    between them instead of one for the whole graph."""

    def fgraph_convert(self, fgraph, input_storage, storage_map, **kwargs):
        from pytensor.link.jax.dispatch import jax_funcify
        self.convert_kwargs = dict(kwargs, input_storage=input_storage, storage_map=storage_map)
        for node in fgraph.apply_nodes:          # (what PyTensor's own conversion asks of every op)
            cls = type(node.op)
            if runs_on_host(node) and cls not in _eager_registered:
                jax_funcify.register(cls)(_eager)
                _eager_registered.add(cls)
        return super().fgraph_convert(fgraph, input_storage, storage_map, **kwargs)

    def jit_compile(self, fn):
        from . import runtime
        from .one_program import OneProgram
        runtime.ensure()
        stretches = Stretches(self.fgraph, on_host=not runtime.local.gpu)
        return OneProgram(self.fgraph, stretches, getattr(self, "convert_kwargs", None))


class Stretches:
    """Runs a graph as jitted stretches and host ops (see the module's docstring)."""

    def __init__(self, fgraph, on_host=False):
        import jax
        self.on_host = on_host          # the device is the CPU: host ops see NumPy views
        self.inputs = list(fgraph.inputs)
        self.outputs = list(fgraph.outputs)
        level, host_at = {}, {}
        stretch_nodes = {}
        for node in fgraph.toposort():
            lv = max((level.get(v, 0) for v in node.inputs), default=0)
            if runs_on_host(node):
                host_at.setdefault(lv, []).append(node)
                for o in node.outputs:
                    level[o] = lv + 1
            else:
                stretch_nodes.setdefault(lv, []).append(node)
                for o in node.outputs:
                    level[o] = lv
        consumers = {}
        for node in fgraph.apply_nodes:
            for v in node.inputs:
                consumers.setdefault(v, []).append(node)
        static = {o for nodes in host_at.values() for n in nodes if getattr(n.op, "static_value", False)
                  for o in n.outputs}
        self.steps = []
        top = max(list(host_at) + list(stretch_nodes) + [0])
        for lv in range(top + 1):
            nodes = stretch_nodes.get(lv)
            if nodes:
                self.steps.append(("jit",) + self._stretch(nodes, consumers, static, jax))
            for node in host_at.get(lv, ()):
                self.steps.append(("host", node, [v.type.dtype if hasattr(v.type, "dtype") else None
                                                  for v in node.inputs]))

    def _stretch(self, nodes, consumers, static, jax):
        from pytensor.link.jax.dispatch import jax_funcify
        inside = set(nodes)
        made = {o for n in nodes for o in n.outputs}
        ins, seen = [], set()
        for n in nodes:
            for v in n.inputs:
                if v not in made and not isinstance(v, Constant) and v not in seen:
                    seen.add(v)
                    ins.append(v)
        outs = [o for o in made if o in self.outputs or any(c not in inside for c in consumers.get(o, ()))]
        order = {n: i for i, n in enumerate(nodes)}
        outs.sort(key=lambda o: (order[o.owner], o.index))
        fg = FunctionGraph(ins, outs, clone=True)
        fn = jax_funcify(fg)
        static_nums = tuple(i for i, v in enumerate(ins) if v in static)
        return Held(jax.jit(fn, static_argnums=static_nums)), ins, outs, set(static_nums)

    def __call__(self, *args):
        env = dict(zip(self.inputs, args))
        for step in self.steps:
            if step[0] == "jit":
                _, fn, ins, outs, static = step
                vals = fn(*[int(env[v]) if i in static else env[v] for i, v in enumerate(ins)])
                env.update(zip(outs, vals))
            else:
                _, node, dtypes = step
                vals = [_value(env, v, dt, self.on_host) for v, dt in zip(node.inputs, dtypes)]
                res = node.op.compute(*vals)
                if getattr(node.op, "static_value", False):
                    env[node.outputs[0]] = res           # (a static integer, where a stretch reads it)
                else:
                    env[node.outputs[0]] = _on_device(res, node.outputs[0].type.dtype)
        return [v.data if isinstance(v, Constant) else env[v] for v in self.outputs]


def _value(env, v, dtype, on_host):
    """``v``'s value for a host op, in its declared dtype (JAX's x64 mode can widen sums)."""
    x = v.data if isinstance(v, Constant) else env[v]
    if on_host:
        x = np.asarray(x)                # a view of a CPU device array
    if dtype is not None and getattr(x, "dtype", None) is not None and x.dtype != dtype:
        x = x.astype(dtype)
    return x


def _on_device(x, dtype):
    if isinstance(x, (np.ndarray, np.generic)):
        return to_device(np.asarray(x, dtype=dtype))
    if getattr(x, "dtype", None) is not None and x.dtype != dtype:
        return x.astype(dtype)
    return x
