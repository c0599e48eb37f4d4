"""What the local-step strategies (``EASGD``, ``LocalSGD``) share: one compiled function
that runs this rank's gradient *and* the update rule (no all-reduce), and the step that
calls it and, every few steps, the strategy's exchange."""
import numpy as np
from pytensor.graph.replace import clone_replace

import synkhronos as synk
from synkhronos.function import call_then

from .. import train
from .common import as_list, before_distribute


class LocalTrainFunction:
    """Base of the local-step strategies (``EASGD``, ``LocalSGD``): ``step(*data, ...)``
    runs ``local_function`` (this rank's gradient and update rule, on its rows of the
    batch; the loss returned is averaged over the ranks) and, every few steps, the
    exchange.  Attributes: ``local_function``, ``params``, ``inputs``, ``state_vars``
    (what a step writes), ``t`` (steps so far)."""

    def __init__(self, f_local, params, state, inputs):
        self.local_function, self.params, self.inputs = f_local, list(params), list(inputs)
        self.state_vars = list(state)
        self.t = 0

    def _then(self, t):
        """Follow-up steps chained to step ``t``'s command."""
        return ()

    def _after(self, t):
        """What runs once step ``t`` is done."""

    def __call__(self, *data, batch=None, num_slices=1, **call_kwargs):
        data, call_kwargs = train.legacy_data_names("the training step", self.inputs, data, call_kwargs)
        output_subset = call_kwargs.pop("output_subset", None)
        batch_s = call_kwargs.pop("batch_s", None)
        t = self.t + 1
        loss = call_then(self.local_function, data, call_kwargs, output_subset, batch, batch_s, num_slices,
                                           self._then(t))
        self.t = t
        self._after(t)
        return loss

    def snapshot(self):
        return [np.array(v.get_value(borrow=True), copy=True) for v in self.state_vars]

    def restore(self, values, t=0):
        """Set ``state_vars`` on every rank (``synk.broadcast``) and the step count."""
        for v, val in zip(self.state_vars, values):
            v.set_value(np.array(val, copy=True))
        synk.broadcast(self.state_vars)
        self.t = t


def _local_function(loss, in_vars, grad_updates, param_updates, grad_shared, bcast_inputs, givens,
                    sliceable_shareds, name):
    """One compiled function: this rank's gradient on its rows, then the update rule with
    it (the gradient shared variable replaced by its expression: no all-reduce)."""
    targets = {id(g) for g in as_list(grad_shared)}
    replace = {g: e for g, e in grad_updates if id(g) in targets}
    extra = [(v, e) for v, e in grad_updates if id(v) not in targets]       # e.g. batch-norm statistics
    exprs = clone_replace([e for _, e in param_updates], replace=replace)
    ups = list(zip([v for v, _ in param_updates], exprs)) + extra
    return synk.function(in_vars, outputs=loss, bcast_inputs=bcast_inputs, updates=ups, givens=givens,
                         sliceable_shareds=sliceable_shareds, name=f"{name}_local")


def local_parts(loss, params, inputs, *args, update_rule=None, x=None, y=None, bcast_inputs=None,
                givens=None, sliceable_shareds=None, name="train", **kwargs):
    """From ``make_train_function``'s arguments: ``(local function, params, state, inputs)``,
    the arguments of a ``LocalTrainFunction`` (``state``: what the update rule writes)."""
    before_distribute("an exchange strategy")
    in_vars, rule, rest = train.parse_form("make_train_function", inputs, args, update_rule, x, y)
    grad_updates, param_updates, grad_shared = rule(loss, params, *rest, **kwargs)
    f_local = _local_function(loss, in_vars, grad_updates, param_updates, grad_shared, bcast_inputs, givens,
                              sliceable_shareds, name)
    state = [v for v, _ in param_updates]
    return f_local, as_list(params), state, in_vars + as_list(bcast_inputs or [])
