"""Plain PyTensor functions for the master alone, compiled as the session compiles its
functions (its device's mode: numba on CPU ranks, JAX on JAX ranks), whose values live
where the session's shared variables live: the serial reference of a training step whose
own graph runs only on the ranks (sharded updates)."""
from .session import get_session

__all__ = ["serial_function"]


def serial_function(inputs, outputs, updates=(), givens=None):
    """A plain PyTensor function compiled as this session compiles its functions (its
    device's mode), for the master alone: ``call(*values) -> [outputs]``, applying
    ``updates`` (pairs) to the master's shared variables.  The serial reference of a step
    whose own graph runs only on the ranks (sharded updates)."""
    session = get_session()
    pairs = [tuple(u) for u in updates]
    outputs = list(outputs)
    fn = session.device.compile(list(inputs), outputs + [u for _, u in pairs], givens=givens)
    fn.trust_input = False

    def call(*values):
        res = fn(*values)
        for (var, _), value in zip(pairs, res[len(outputs):]):
            session.device.set(var, value)
        return res[:len(outputs)]
    return call
