"""Random generators on JAX ranks.

PyTensor's JAX backend draws from a dict (numpy's bit generator state plus the key JAX
draws from, ``jax_state``) and, when a graph reads a generator *shared* variable, compiles
a private copy of it into the function: the shared variable never advances, two functions
of one generator draw the same numbers, and such a function cannot be pickled (its copy
breaks PyTensor's unpickling check).  Here a function's generators are explicit inputs
instead (``explicit``): the shared variable holds the dict, every function that reads it
is given its current value at each call (``DrawingFunction``) and its update comes back as
an output like any other, so the variable is the one truth, as on numba ranks."""
import numpy as np

__all__ = ["explicit", "DrawingFunction", "as_jax", "state_of", "from_state"]


def explicit(inputs, outputs, givens):
    """``(inputs, givens, generators)``: the generator shared variables the graph of
    ``outputs`` (and ``givens``' values) reads, each replaced by a new explicit input
    appended to ``inputs``."""
    from pytensor.compile.sharedvalue import SharedVariable
    from pytensor.graph.traversal import ancestors
    from pytensor.tensor.random.type import RandomType

    pairs = list(givens.items()) if isinstance(givens, dict) else [tuple(g) for g in (givens or [])]
    roots = (list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]) + [v for _, v in pairs]
    replaced = {id(k) for k, _ in pairs}
    gens = [v for v in ancestors(roots)
            if isinstance(v, SharedVariable) and isinstance(v.type, RandomType) and id(v) not in replaced]
    if not gens:
        return inputs, givens, []
    syms = [g.type() for g in gens]
    return list(inputs) + syms, pairs + list(zip(gens, syms)), gens


class DrawingFunction:
    """A compiled PyTensor function whose last inputs are the current values of the
    generator shared variables ``gens``; called with the other inputs only."""

    def __init__(self, fn, gens):
        self.fn, self.gens = fn, list(gens)

    def __call__(self, *args):
        return self.fn(*args, *[g.container.storage[0] for g in self.gens])

    @property
    def maker(self):
        return self.fn.maker

    @property
    def trust_input(self):
        return self.fn.trust_input

    @trust_input.setter
    def trust_input(self, value):
        self.fn.trust_input = value

    def get_shared(self):
        return self.fn.get_shared() + self.gens


def as_jax(value):
    """What a JAX function draws from, for a generator shared variable's ``value`` (a numpy
    Generator, or already such a dict): JAX arrays throughout (PyTensor checks a dict's
    ``bit_generator`` only when it is an array)."""
    import jax
    import jax.numpy as jnp
    if isinstance(value, np.random.Generator):
        from pytensor.link.jax.dispatch import jax_typify
        value = jax_typify(value)
    return jax.tree_util.tree_map(jnp.asarray, value)


def state_of(value):
    """The JSON-able state (``synkhronos.generators``) of a JAX generator value, with its
    bit generator by name."""
    from pytensor.tensor.random.type import numpy_bit_gens
    from ... import generators
    state = generators.to_json(value, dtypes=True)       # 32-bit words stay 32-bit
    state["bit_generator"] = numpy_bit_gens[int(np.asarray(value["bit_generator"]))]
    return state


def from_state(state):
    """The JAX generator value continuing JSON ``state``: a state drawn by JAX continues
    its key; a numpy one (from numba ranks) gets the key PyTensor derives from it."""
    from pytensor.link.jax.dispatch.random import numpy_bit_gens
    from ... import generators
    gen = generators.generator(state)      # checks it; JAX states need no numpy stream
    if "jax_state" not in state:
        return as_jax(gen)
    value = generators.from_json(state)
    value["bit_generator"] = numpy_bit_gens[state["bit_generator"]]
    value["jax_state"] = np.asarray(value["jax_state"], np.uint32)
    return as_jax(value)
