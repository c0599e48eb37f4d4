"""One callable data-parallel training step built from an update rule of ``updates``.

    step = make_train_function(loss, params, [x, y], updates.momentum, learning_rate=0.1)
    synk.distribute()
    loss_value = step(x_data, y_data, batch=idx)     # all ranks, one all-reduce
    loss_value = step.serial(x_arr[idx], y_arr[idx])  # plain PyTensor in the master only

A step runs the gradient function on every rank (each on its share of the batch; the loss
is averaged), ``synk.all_reduce(grad_shared, op="avg")``, then the parameter-update
function on every rank.  ``serial`` calls the same two compiled functions in the master
through ``Function.as_theano`` (no workers, no all-reduce): the single-process equivalent,
which costs no extra compilation.
"""
import numpy as np

import synkhronos as synk
from synkhronos.runtime import get_runtime

__all__ = ["make_train_function", "TrainFunction"]


class TrainFunction:
    """The callable returned by ``make_train_function``.

    Attributes: ``grad_function`` and ``update_function`` (the two ``synk.Function``),
    ``grad_shared`` (the flat gradient vector), ``params``, ``grad_updates``,
    ``param_updates``, ``state_vars`` (every shared variable a step writes: the flat
    gradient, the parameters and the rule's state)."""

    def __init__(self, grad_function, update_function, grad_shared, params, grad_updates,
                 param_updates):
        self.grad_function, self.update_function = grad_function, update_function
        self.grad_shared = grad_shared
        self.params = list(params) if isinstance(params, (list, tuple)) else [params]
        self.grad_updates, self.param_updates = grad_updates, param_updates
        seen, state = set(), []
        for v in [grad_shared] + [v for v, _ in param_updates]:
            if id(v) not in seen:
                seen.add(id(v))
                state.append(v)
        self.state_vars = state

    def __call__(self, *data, batch=None, num_slices=1, **call_kwargs):
        """One data-parallel step on ``data`` (``synk.Data`` or arrays, as for the gradient
        function; ``batch``/``batch_s``/``num_slices`` select rows).  Returns the loss,
        averaged over the whole batch."""
        loss = self.grad_function(*data, batch=batch, num_slices=num_slices, **call_kwargs)
        synk.all_reduce(self.grad_shared, op="avg")
        self.update_function()
        return loss

    def serial(self, *arrays, **named):
        """The same step as plain PyTensor in the master only, on the full ``arrays``
        (numpy arrays of the inputs' exact dtypes).  Updates the master's variables only."""
        loss = self.grad_function.as_theano(*arrays, **named)
        self.update_function.as_theano()
        return loss

    def snapshot(self):
        """Copies of the master's values of ``state_vars`` (for ``restore``)."""
        return [np.array(v.get_value(borrow=True), copy=True) for v in self.state_vars]

    def restore(self, values):
        """Set ``state_vars`` to ``values`` (from ``snapshot``): on every rank once the
        functions are distributed (``synk.broadcast``), else in the master."""
        if len(values) != len(self.state_vars):
            raise ValueError(f"restore needs {len(self.state_vars)} values, got {len(values)}")
        if get_runtime().distributed:
            synk.broadcast(self.state_vars, list(values))
        else:
            for v, val in zip(self.state_vars, values):
                v.set_value(np.array(val, copy=True))


def make_train_function(loss, params, inputs, update_rule, *args, bcast_inputs=None, givens=None,
                        sliceable_shareds=None, name="train", **kwargs):
    """Build the two synkhronos functions of a data-parallel training step.

    ``update_rule(loss, params, *args, **kwargs)`` is a rule of
    ``synkhronos.extensions.updates`` (e.g. ``updates.adam``, ``learning_rate=1e-3``).
    ``inputs``/``bcast_inputs``/``givens``/``sliceable_shareds`` are those of the gradient
    function (``synk.function``).  Call after ``synk.fork()`` and before
    ``synk.distribute()``.  Returns a ``TrainFunction``:
    ``step(*data, batch=None, num_slices=1, **call_kwargs) -> loss``."""
    grad_updates, param_updates, grad_shared = update_rule(loss, params, *args, **kwargs)
    f_grad = synk.function(inputs, outputs=loss, bcast_inputs=bcast_inputs, updates=grad_updates,
                           givens=givens, sliceable_shareds=sliceable_shareds, name=f"{name}_grad")
    f_update = synk.function([], updates=param_updates, name=f"{name}_update")
    return TrainFunction(f_grad, f_update, grad_shared, params, grad_updates, param_updates)
