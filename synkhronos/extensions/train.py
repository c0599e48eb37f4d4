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

The original Synkhronos' forms work too: ``make_train_function(loss, params, x, y,
update_rule, *args, **kwargs)`` (two input variables instead of the list; also as
``x=``, ``y=``, ``update_rule=`` keywords), and ``make_train_function_theano`` with the
same arguments builds the plain single-process PyTensor step (no synkhronos session).
"""
import numpy as np
from pytensor.graph.basic import Variable

import synkhronos as synk
from synkhronos.compiling import compiling
from synkhronos.function_args import parse_updates
from synkhronos.function import call_then, compiled, replica_of
from synkhronos.session import get_session

from . import strategies

__all__ = ["make_train_function", "make_train_function_theano", "TrainFunction",
           "SerialTrainFunction"]

_USAGE = ("{fn}(loss, params, inputs, update_rule, *args, **kwargs), with inputs the list of "
          "input variables, e.g. {fn}(loss, params, [x, y], updates.sgd, learning_rate=0.1); "
          "the original form {fn}(loss, params, x, y, update_rule, *args, **kwargs) is accepted too")


def parse_form(fn, inputs, args, update_rule, x, y):
    """Both call forms -> ``(input variables, update_rule, remaining positional args)``.

    New form: ``inputs`` is a list/tuple of variables (or one variable), followed by
    ``update_rule``.  Original form: two input variables ``x, y`` in place of the list.  The
    two cannot be confused: in the new form the argument after ``inputs`` is the update
    rule, a function, never a variable."""
    usage = _USAGE.format(fn=fn)
    pos = ([] if inputs is None else [inputs]) + list(args)
    old = x is not None or y is not None
    if not old and len(pos) >= 2 and isinstance(pos[0], Variable) and isinstance(pos[1], Variable):
        x, y, pos, old = pos[0], pos[1], pos[2:], True          # (loss, params, x, y, rule, ...)
    elif old and x is None and pos and isinstance(pos[0], Variable):
        x = pos.pop(0)                                           # (loss, params, x, y=y, ...)
    if old:
        if not (isinstance(x, Variable) and isinstance(y, Variable)):
            raise TypeError(f"{fn}: the original form takes two input variables x and y, got "
                            f"x={x!r}, y={y!r}. Call {usage}")
        in_vars = [x, y]
    else:
        if not pos:
            raise TypeError(f"{fn}() missing the input variables. Call {usage}")
        first = pos.pop(0)
        if isinstance(first, Variable):
            in_vars = [first]
        elif isinstance(first, (list, tuple)) and all(isinstance(v, Variable) for v in first):
            in_vars = list(first)
        else:
            raise TypeError(f"{fn}: inputs must be a list of input variables, got {first!r}. Call {usage}")
    if update_rule is None:
        if not pos:
            raise TypeError(f"{fn}() missing the update rule. Call {usage}")
        update_rule = pos.pop(0)
    if isinstance(update_rule, Variable) or not callable(update_rule):
        raise TypeError(f"{fn}: update_rule must be a rule of synkhronos.extensions.updates "
                        f"(a function), got {update_rule!r}. Call {usage}")
    return in_vars, update_rule, pos


_parse_form = parse_form          # (its former name, used by tests/test_updates.py)


def _as_var_list(v):
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _master_values(variables):
    """Copies of the master's values of ``variables``."""
    return [np.array(v.get_value(borrow=True), copy=True) for v in variables]


def _set_master_values(variables, values, what):
    """The master's ``variables`` set to copies of ``values``, one each (``what``: the
    method, for the error)."""
    if len(values) != len(variables):
        raise ValueError(f"{what} needs {len(variables)} values, got {len(values)}")
    for v, val in zip(variables, values):
        v.set_value(np.array(val, copy=True))


def legacy_data_names(fn, inputs, data, named):
    """The original step was ``train_minibatch(x_data, y_data, batch=None)``: accept those
    two keywords for a step with two inputs (unless an input has such a name)."""
    if not ({"x_data", "y_data"} & set(named)) or len(inputs) != 2 \
            or any(v.name in ("x_data", "y_data") for v in inputs):
        return data, named
    if len(data) > 2:
        raise TypeError(f"{fn} takes 2 data inputs, got {len(data)} positional")
    named = dict(named)
    vals = list(data) + [None] * (2 - len(data))
    for i, key in enumerate(("x_data", "y_data")):
        if key in named:
            if vals[i] is not None:
                raise TypeError(f"{fn} got {key} twice")
            vals[i] = named.pop(key)
    if any(v is None for v in vals):
        raise TypeError(f"{fn} is missing {'x_data' if vals[0] is None else 'y_data'}")
    return vals, named


class TrainFunction:
    """The callable returned by ``make_train_function``.

    Attributes: ``grad_function`` and ``update_function`` (the two ``synk.Function``),
    ``grad_shared`` (the flat gradient vector, or the list of per-parameter gradients of
    ``updates.sgd_nonflat``), ``params``, ``inputs`` (the input variables, scattered then
    broadcast), ``grad_updates``, ``param_updates``, ``state_vars`` (every shared variable
    a step writes: the gradient(s), the parameters and the rule's state)."""

    def __init__(self, grad_function, update_function, grad_shared, params, grad_updates,
                 param_updates, inputs=()):
        self.grad_function, self.update_function = grad_function, update_function
        self.grad_shared = grad_shared
        self.params = _as_var_list(params)
        self.inputs = list(inputs)
        self.grad_updates, self.param_updates = grad_updates, param_updates
        self._then = None
        seen, state = set(), []
        for v in _as_var_list(grad_shared) + [v for v, _ in param_updates]:
            if id(v) not in seen:
                seen.add(id(v))
                state.append(v)
        self.state_vars = state

    def __call__(self, *data, batch=None, num_slices=1, **call_kwargs):
        """One data-parallel step on ``data`` (``synk.Data`` or arrays, as for the gradient
        function; ``batch``/``batch_s``/``num_slices`` select rows).  Returns the loss,
        averaged over the whole batch.  The original's keywords ``x_data``/``y_data`` work
        for a step with two inputs."""
        data, call_kwargs = legacy_data_names("the training step", self.inputs, data, call_kwargs)
        f = self.grad_function
        if self._then is None:
            self._then = self._chain()
        if self._then and compiled(self.update_function):
            # one round trip: gradient, all-reduce and update rule in the same command
            output_subset = call_kwargs.pop("output_subset", None)
            batch_s = call_kwargs.pop("batch_s", None)
            return call_then(f, data, call_kwargs, output_subset, batch, batch_s, num_slices, self._then)
        loss = f(*data, batch=batch, num_slices=num_slices, **call_kwargs)
        self._exchange()
        self.update_function()
        return loss

    def _exchange(self):
        """The gradient's exchange when the step is not chained (three round trips)."""
        synk.all_reduce(_as_var_list(self.grad_shared), op="avg")

    def _chain(self):
        """The follow-ups of the gradient call (``replica.follow_up``): () when the step
        cannot be chained (not distributed yet)."""
        session = get_session()
        if not session.distributed:
            return ()
        steps = tuple(("all_reduce", session.shared_ids[id(g)], "avg")
                      for g in _as_var_list(self.grad_shared))
        return steps + (("run", replica_of(self.update_function).fid),)

    def serial(self, *arrays, **named):
        """The same step as plain PyTensor in the master only, on the full ``arrays``
        (numpy arrays of the inputs' exact dtypes).  Updates the master's variables only."""
        arrays, named = legacy_data_names("serial", self.inputs, arrays, named)
        loss = self.grad_function.as_theano(*arrays, **named)
        self.update_function.as_theano()
        return loss

    def snapshot(self):
        """Copies of the master's values of ``state_vars`` (for ``restore``)."""
        return _master_values(self.state_vars)

    def serial_snapshot(self):
        """Copies of the values ``serial`` reads and writes, in the master only (no
        collective): to keep several serial references and take turns between them (with
        ``serial_restore``) without touching the ranks."""
        return _master_values(self._serial_vars())

    def serial_restore(self, values):
        """Set the values ``serial`` reads and writes (from ``serial_snapshot``), in the
        master only."""
        _set_master_values(self._serial_vars(), values, "serial_restore")

    def _serial_vars(self):
        """The shared variables ``serial`` reads and writes: here, ``state_vars``."""
        return self.state_vars

    def restore(self, values):
        """Set ``state_vars`` to ``values`` (from ``snapshot``): in the master, and on every
        rank (``synk.broadcast``) once the functions are distributed."""
        _set_master_values(self.state_vars, values, "restore")
        try:
            synk.broadcast(self.state_vars)
        except synk.SynkError:
            raise
        except RuntimeError:
            # not distributed yet (distribute() sends the master's values) or the session
            # is closed: the master's values are all there is to set
            pass


def make_train_function(loss, params, inputs=None, *args, update_rule=None, x=None, y=None,
                        bcast_inputs=None, givens=None, sliceable_shareds=None, name="train",
                        compress=None, error_feedback=True, exchange=None, shard_updates=False,
                        **kwargs):
    """Build the two synkhronos functions of a data-parallel training step.

    ``make_train_function(loss, params, inputs, update_rule, *args, **kwargs)``:
    ``update_rule(loss, params, *args, **kwargs)`` is a rule of
    ``synkhronos.extensions.updates`` (e.g. ``updates.adam``, ``learning_rate=1e-3``).
    ``inputs`` (a list of variables) and ``bcast_inputs``/``givens``/``sliceable_shareds``
    are those of the gradient function (``synk.function``).  The original Synkhronos' form
    ``make_train_function(loss, params, x, y, update_rule, *args, **kwargs)`` (also with
    ``x=``, ``y=``, ``update_rule=`` keywords) means ``inputs=[x, y]``.  Call after
    ``synk.fork()`` and before ``synk.distribute()``.  Returns a ``TrainFunction``:
    ``step(*data, batch=None, num_slices=1, **call_kwargs) -> loss``.

    ``exchange`` picks the strategy: ``"bsp"`` (the default: the step above), ``"fp16"`` or
    ``Fp16(...)`` (float16 gradient all-reduce; also ``compress="fp16"``, with
    ``error_feedback``), ``"easgd"`` or ``EASGD(tau, alpha)``, ``"local"`` or
    ``LocalSGD(k)`` (``synkhronos.extensions.exchange``, which builds those steps; it is
    also ``exchange.make_train_function``).

    ``shard_updates=True`` shards the rule's state and work over the ranks (ZeRO stage 1,
    ``synkhronos.extensions.sharded``): each rank keeps and updates 1/n of it, the gradient
    is reduce-scattered and the new parameters all-gathered, all in one function
    (``num_slices`` must then be 1); the bsp exchange only."""
    strategy = strategies.parse_strategy(exchange, compress, error_feedback)
    if shard_updates and strategy is not None:
        raise ValueError(f"shard_updates=True works with the synchronous (bsp) exchange only, not "
                         f"{type(strategy).__name__}")
    if shard_updates:
        strategy = strategies.ShardedUpdates()
    if strategy is not None:
        build = strategies.builder(strategy)
        return build(strategy, loss, params, inputs, *args, update_rule=update_rule, x=x, y=y,
                     bcast_inputs=bcast_inputs, givens=givens, sliceable_shareds=sliceable_shareds,
                     name=name, **kwargs)
    inputs, update_rule, args = parse_form("make_train_function", inputs, args, update_rule, x, y)
    grad_updates, param_updates, grad_shared = update_rule(loss, params, *args, **kwargs)
    # each rank's gradient as its share of the batch's mean (update mode "share"): the
    # all-reduce's mean over ranks is then the whole batch's gradient, shards uneven or empty
    shares = [(var, value, "share") for var, value, _ in parse_updates(grad_updates)]
    f_grad = synk.function(inputs, outputs=loss, bcast_inputs=bcast_inputs, updates=shares,
                           givens=givens, sliceable_shareds=sliceable_shareds, name=f"{name}_grad")
    f_update = synk.function([], updates=param_updates, name=f"{name}_update")
    return TrainFunction(f_grad, f_update, grad_shared, params, grad_updates, param_updates,
                         inputs + _as_var_list(bcast_inputs or []))


class SerialTrainFunction:
    """The callable returned by ``make_train_function_theano``: one training step as plain
    PyTensor in this process (no synkhronos session, no all-reduce).

    Attributes: ``grad_function`` and ``update_function`` (``pytensor`` functions),
    ``grad_shared``, ``params``, ``inputs``, ``grad_updates``, ``param_updates``."""

    def __init__(self, grad_function, update_function, grad_shared, params, grad_updates,
                 param_updates, inputs):
        self.grad_function, self.update_function = grad_function, update_function
        self.grad_shared, self.params, self.inputs = grad_shared, _as_var_list(params), list(inputs)
        self.grad_updates, self.param_updates = grad_updates, param_updates

    def __call__(self, *arrays, **named):
        """One step on ``arrays`` (one per input, converted as PyTensor converts inputs).
        Returns the loss.  The original's keywords ``x_data``/``y_data`` work for two inputs."""
        arrays, named = legacy_data_names("the training step", self.inputs, arrays, named)
        loss = self.grad_function(*arrays, **named)
        self.update_function()
        return loss


def make_train_function_theano(loss, params, inputs=None, *args, update_rule=None, x=None,
                               y=None, bcast_inputs=None, givens=None, name="train", **kwargs):
    """The single-process equivalent of ``make_train_function`` (same arguments, both
    forms), compiled with plain ``pytensor.function``: no ``synk.fork()`` needed, no
    all-reduce.  Returns a ``SerialTrainFunction``: ``step(*arrays) -> loss``.  (Within a
    synkhronos session, ``TrainFunction.serial`` gives the same without compiling again.)"""
    import pytensor
    inputs, update_rule, args = parse_form("make_train_function_theano", inputs, args,
                                           update_rule, x, y)
    inputs = inputs + _as_var_list(bcast_inputs or [])
    grad_updates, param_updates, grad_shared = update_rule(loss, params, *args, **kwargs)
    with compiling():
        f_grad = pytensor.function(inputs, loss, updates=grad_updates, givens=givens, name=f"{name}_grad")
        f_update = pytensor.function([], [], updates=param_updates, name=f"{name}_update")
    return SerialTrainFunction(f_grad, f_update, grad_shared, params, grad_updates, param_updates,
                               inputs)
