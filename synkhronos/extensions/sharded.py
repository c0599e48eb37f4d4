"""Sharded optimizer state and update (ZeRO stage 1): ``make_train_function(...,
shard_updates=True)``.

The plain step keeps the whole optimizer state on every rank and runs the whole update rule
on every rank.  The sharded step is ONE ``synk.function`` whose graph, on every rank r of n,

1. computes this rank's gradient of all parameters as one flat vector of N numbers;
2. ``ops.reduce_scatter(flat, "avg")``: rank r gets block r, elements
   ``[r*N//n, (r+1)*N//n)``, of the gradient averaged over the ranks;
3. runs the update rule on that block of the parameters with its block of the rule's
   state: each rank holds and updates 1/n of the optimizer state (Adam's moments, ...);
4. ``ops.all_gather`` of the new blocks: every rank gets the whole new parameters, which
   the function's updates write into the parameters' shared variables.

A reduce-scatter and an all-gather move the same bytes as the plain step's one all-reduce;
the gradient, its exchange and the update run in one call (one round trip, no gradient
shared variable).  The results equal the plain step's: the rules are elementwise, and both
average the same gradients in the same order.

The rule's per-rank state (``sharded_vars``) is declared to ``synk.function`` as
``sharded_shareds``: made whole in the master, split over the ranks by ``distribute()``;
checkpoints store it whole, in rank order, and split it again for any number of ranks;
``snapshot``/``restore`` gather and scatter it.  Replicated state (Adam's step count)
stays whole on every rank."""
import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.graph.replace import clone_replace
from pytensor.scalar import upcast

import synkhronos as synk
from synkhronos import ops
from synkhronos.serial import serial_function
from synkhronos.session import get_session

from . import strategies, updates
from .train import TrainFunction, legacy_data_names, parse_form

__all__ = ["make_sharded_train_function", "ShardedTrainFunction"]


def block_bounds(N):
    """Symbolic ``(start, stop)`` of this rank's block of N elements: the blocks of
    ``ops.reduce_scatter`` and of ``synk.scatter`` (``r*N//n``)."""
    r, n = ops.this_rank(), ops.n_ranks()
    return (r * N) // n, ((r + 1) * N) // n


def flat_rule(update_rule, grad, params_flat, length, name, args, kwargs):
    """``(new flat parameters, [(state variable, new value)])``: ``update_rule`` applied to
    one flat vector of parameters ``params_flat`` (an expression) whose gradient is
    ``grad``.  The rule makes its state shaped like a stand-in of ``length`` numbers, flat
    like the parameters, in the rule's order."""
    dtype = params_flat.dtype
    stand_in = pytensor.shared(np.zeros(length, dtype), name=name, shape=(None,))
    _, rule_updates, _ = update_rule(updates.Reduced([grad]), [stand_in], *args, **kwargs)
    rule_updates = list(rule_updates)
    new = [u for v, u in rule_updates if v is stand_in]
    state = [(v, u) for v, u in rule_updates if v is not stand_in]
    if len(new) != 1:
        raise ValueError(f"{getattr(update_rule, '__name__', update_rule)} did not update the parameters once")
    outs = clone_replace([new[0]] + [u for _, u in state], replace={stand_in: params_flat})
    return outs[0], list(zip([v for v, _ in state], outs[1:]))


def sharded_rule(update_rule, loss, params, args, kwargs, rows=None):
    """``(param_updates, sharded_state, state_updates)``: the rule applied to this rank's
    block of the flattened parameters and of the reduced gradient, the new blocks gathered.
    ``rows`` (this rank's rows of the batch, symbolic): each rank's gradient weighs by it in
    the mean over ranks, which is then the whole batch's gradient however uneven the shards
    (one scalar all-reduce more: the rows of every rank); None: equal weights."""
    dtype = upcast(*[p.dtype for p in params])
    N = updates.vars_flat_size(params)
    start, stop = block_bounds(N)
    flat = updates.flatten_vars(pytensor.grad(loss, params), dtype)
    if rows is not None:
        mine = pt.cast(rows, "float64")
        flat = flat * pt.cast(mine * ops.n_ranks() / ops.all_reduce(mine, "sum"), dtype)
    g_block = ops.reduce_scatter(flat, op="avg")
    p_block = updates.flatten_vars(params, dtype)[start:stop]
    # the state is made whole (N) in the master; distribute() gives each rank its block
    new_block, state_updates = flat_rule(update_rule, g_block, p_block, N, "params_block", args, kwargs)
    new_flat = ops.all_gather(new_block)
    param_updates = list(zip(params, updates.unflatten_vars(new_flat, params)))
    sharded = [v for v, _ in state_updates if v.type.ndim == 1 and v.type.shape == (None,)]
    return param_updates, sharded, state_updates


def serial_rule(update_rule, loss, params, args, kwargs):
    """``(param_updates, state_updates)`` of the same rule on the whole flat parameters, with
    whole flat state in the same order as ``sharded_rule``'s (the serial reference)."""
    dtype = upcast(*[p.dtype for p in params])
    flat = updates.flatten_vars(params, dtype)
    grad = updates.flatten_vars(pytensor.grad(loss, params), dtype)
    new_flat, state_updates = flat_rule(update_rule, grad, flat, updates.vars_flat_size(params),
                                        "params_flat", args, kwargs)
    return list(zip(params, updates.unflatten_vars(new_flat, params))), state_updates


class ShardedTrainFunction(TrainFunction):
    """The step of ``make_train_function(..., shard_updates=True)``: ``grad_function`` is the
    one function that computes, exchanges and applies (``update_function`` and
    ``grad_shared`` are None); ``sharded_vars`` the rule's state split over the ranks."""

    def __init__(self, function, params, param_updates, state_updates, sharded_vars, inputs,
                 serial_builder):
        super().__init__(function, None, [], params, [], param_updates + state_updates, inputs)
        self.grad_shared, self.state_updates = None, list(state_updates)
        self.sharded_vars = list(sharded_vars)
        self._serial_builder, self._serial = serial_builder, None

    def __call__(self, *data, batch=None, num_slices=1, **call_kwargs):
        """One data-parallel step (as ``TrainFunction``); ``num_slices`` must be 1: the
        update is part of the call."""
        if num_slices != 1:
            raise ValueError(f"a step with shard_updates=True applies the update within its call and "
                             f"cannot accumulate over num_slices={num_slices}; use num_slices=1 (or a "
                             "smaller batch), or shard_updates=False")
        data, call_kwargs = legacy_data_names("the training step", self.inputs, data, call_kwargs)
        return self.grad_function(*data, batch=batch, **call_kwargs)

    def serial(self, *arrays, **named):
        """The same step as plain PyTensor in the master, on the whole batch (compiled at the
        first call): the serial reference.  It keeps its own whole copy of the rule's state,
        which ``restore`` sets too."""
        arrays, named = legacy_data_names("serial", self.inputs, arrays, named)
        if named:
            raise TypeError(f"serial takes the input arrays by position, got {sorted(named)}")
        if self._serial is None:
            self._serial = self._serial_builder()
        return self._serial[0](*arrays)[0]

    def _serial_vars(self):
        """The parameters and the serial reference's own copy of the rule's state."""
        if self._serial is None:
            self._serial = self._serial_builder()
        return list(self.params) + list(self._serial[1])

    def snapshot(self):
        """Copies of ``state_vars``: sharded state gathered whole, in rank order."""
        if not self._distributed():
            return super().snapshot()
        sharded = {id(v) for v in self.sharded_vars}
        gathered = _as_tuple(synk.gather(self.sharded_vars, nd_up=0)) if self.sharded_vars else ()
        whole = dict(zip(map(id, self.sharded_vars), gathered))    # (a rule without state: none)
        return [np.array(whole[id(v)] if id(v) in sharded else v.get_value(borrow=True), copy=True)
                for v in self.state_vars]

    def restore(self, values):
        """Set ``state_vars`` to ``values`` (from ``snapshot``): replicated state broadcast,
        sharded state split over the ranks again."""
        if not self._distributed():
            return super().restore(values)
        if len(values) != len(self.state_vars):
            raise ValueError(f"restore needs {len(self.state_vars)} values, got {len(values)}")
        sharded = {id(v) for v in self.sharded_vars}
        whole = [(v, val) for v, val in zip(self.state_vars, values) if id(v) not in sharded]
        for v, val in whole:
            v.set_value(np.array(val, copy=True))
        synk.broadcast([v for v, _ in whole])
        split = [(v, val) for v, val in zip(self.state_vars, values) if id(v) in sharded]
        if split:
            synk.scatter([v for v, _ in split], [np.asarray(val) for _, val in split])
        if self._serial is not None:          # the serial reference's own copy of the state
            values_of = {id(v): val for v, val in zip(self.state_vars, values)}
            for mine, theirs in zip(self._serial[1], [v for v, _ in self.state_updates]):
                mine.set_value(np.array(values_of[id(theirs)], copy=True))

    @staticmethod
    def _distributed():
        try:
            return get_session().distributed
        except RuntimeError:
            return False


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def make_sharded_train_function(strategy, loss, params, inputs=None, *args, update_rule=None, x=None, y=None,
                                bcast_inputs=None, givens=None, sliceable_shareds=None, name="train",
                                **kwargs):
    """The sharded step (see the module's docstring): ``make_train_function``'s builder for
    ``shard_updates=True`` (``strategies.ShardedUpdates``), with its arguments."""
    inputs, update_rule, args = parse_form("make_train_function", inputs, args, update_rule, x, y)
    if update_rule is updates.sgd_nonflat:
        raise ValueError("shard_updates=True shards the flat gradient vector; sgd_nonflat keeps one "
                         "gradient per parameter: use updates.sgd")
    params = updates.check_params(params)
    rows = inputs[0].shape[0] if inputs else None      # (batch_s alone: every rank weighs the same)
    param_updates, sharded, state_updates = sharded_rule(update_rule, loss, params, args, kwargs, rows)
    all_inputs = list(inputs) + list(bcast_inputs or [])
    f = synk.function(inputs, outputs=loss, bcast_inputs=bcast_inputs,
                      updates=param_updates + state_updates, givens=givens,
                      sliceable_shareds=sliceable_shareds, sharded_shareds=sharded, name=name)

    def serial_builder():
        p_updates, s_updates = serial_rule(update_rule, loss, params, args, kwargs)
        step = serial_function(all_inputs, [loss], p_updates + s_updates, givens)
        return step, [v for v, _ in s_updates]
    return ShardedTrainFunction(f, params, param_updates, state_updates, sharded, all_inputs, serial_builder)


strategies.register(strategies.ShardedUpdates, make_sharded_train_function)
