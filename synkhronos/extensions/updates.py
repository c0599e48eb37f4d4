"""Lasagne's first-order update rules, split for data-parallel training.

A data-parallel step is three calls:

1. a gradient function (``synk.function(inputs, outputs=loss, updates=grad_updates)``)
   writes this rank's gradient of *all* parameters into ONE flat shared vector;
2. ``synk.all_reduce(grad_shared, op="avg")`` averages that vector over the ranks
   (one collective per step, however many parameters the model has);
3. a parameter-update function (``synk.function([], updates=param_updates)``) reads the
   averaged gradient, as reshaped slices of the flat vector, and applies the rule.

Every rule returns ``(grad_updates, param_updates, grad_shared)``:
``grad_updates == [(grad_shared, flat_grad)]``, ``param_updates`` a list of
``(shared, new_value)`` pairs, ``grad_shared`` the flat vector (dtype of the parameters).
The formulas and defaults are Lasagne's (``lasagne.updates``); as there, ``loss`` may
also be a list of gradient expressions, one per parameter.  Hyperparameters may be
numbers or symbolic scalars (e.g. a shared learning rate: remember to ``synk.broadcast`` it
after changing it in the master).  Every rank keeps its own copy of the rule's state
(velocities, moments, time step); all ranks apply identical updates, so the copies agree.
``synkhronos.extensions.train.make_train_function`` wires the three steps together.

``nonflat_grads`` and ``sgd_nonflat`` (from the original Synkhronos) keep one gradient
shared variable per parameter instead of the flat vector: the all-reduce then takes the
list, one collective per parameter (slower for many parameters; kept for comparison).

Keyword names of the original Synkhronos and of Lasagne are both accepted where they
differ: ``loss`` / ``loss_or_grads`` (every rule, ``flat_unflat_grads``,
``nonflat_grads``), ``variables`` / ``like`` (``unflatten_vars``), ``updates`` /
``param_updates`` (``apply_momentum``, ``apply_nesterov_momentum``).
"""
import functools
import inspect
from collections import OrderedDict

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Variable
from pytensor.scalar import upcast

__all__ = ["sgd", "momentum", "nesterov_momentum", "apply_momentum", "apply_nesterov_momentum",
           "adagrad", "rmsprop", "adadelta", "adam", "adamax", "sgd_nonflat",
           "flatten_vars", "unflatten_vars", "vars_flat_size", "flat_unflat_grads",
           "nonflat_grads", "Reduced"]


# ------------------------------------------------------------------------------------------
# Helpers


def _keyword_aliases(**aliases):
    """Accept ``alias=value`` as another spelling of the keyword ``name`` (``alias="name"``).

    Giving both spellings, or the alias together with the argument in its position, is a
    TypeError, as Python reports for any argument given twice.  The aliases are listed in
    the wrapper's ``keyword_aliases`` (alias -> name)."""
    def deco(fn):
        positions = {n: i for i, n in enumerate(inspect.signature(fn).parameters)}

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            for alias, name in aliases.items():
                if alias in kwargs:
                    if name in kwargs or len(args) > positions[name]:
                        raise TypeError(f"{fn.__name__}() got {name!r} twice: {alias!r} is another "
                                        f"name for {name!r}; give one of them")
                    kwargs[name] = kwargs.pop(alias)
            return fn(*args, **kwargs)
        wrapper.keyword_aliases = dict(aliases)
        return wrapper
    return deco


class _Default(float):
    """A default value that can be told from the same number passed explicitly."""
    __slots__ = ()

    def __repr__(self):
        return repr(float(self))


_MOMENTUM = _Default(0.9)


def check_params(params):
    """``params`` as a list of float shared variables, each once (TypeError/ValueError otherwise)."""
    if isinstance(params, (SharedVariable, Variable)):
        params = [params]
    params = list(params)
    if not params:
        raise ValueError("params is empty: give the list of shared variables to train")
    for p in params:
        if not isinstance(p, SharedVariable):
            raise TypeError(f"params must be shared variables (they hold the values), got {p!r}")
        if np.dtype(p.type.dtype).kind != "f":
            raise TypeError(f"parameter {p} has dtype {p.type.dtype}; only float parameters can be trained")
    if len({id(p) for p in params}) != len(params):
        raise ValueError("the same parameter appears more than once in params")
    return params


def _const(value, dtype):
    """A hyperparameter as a scalar of ``dtype`` (symbolic values are cast, not copied)."""
    if isinstance(value, Variable):
        return value if value.dtype == dtype else pt.cast(value, dtype)
    return pt.constant(np.asarray(value, dtype=dtype))


def _state_like(param, what, value=0.0):
    """A shared variable shaped and typed like ``param``, filled with ``value``."""
    v = param.get_value(borrow=True)
    name = f"{param.name}_{what}" if param.name else what
    return pytensor.shared(np.full(v.shape, value, dtype=v.dtype), name=name, shape=param.type.shape)


def _cast_like(expr, var):
    return expr if expr.dtype == var.dtype else pt.cast(expr, var.dtype)


def _as_pairs(updates):
    """Update list or dict -> list of (shared, expression)."""
    if isinstance(updates, dict):
        return list(updates.items())
    pairs = [tuple(u) for u in updates]
    for u in pairs:
        if len(u) != 2:
            raise TypeError(f"updates must be (shared_var, new_value) pairs; got {u!r}")
    return pairs


def vars_flat_size(variables):
    """Total number of elements in the current values of shared ``variables``."""
    return int(sum(v.get_value(borrow=True).size for v in variables))


def flatten_vars(variables, dtype=None):
    """One flat vector: the concatenation of every variable flattened (cast to ``dtype``)."""
    variables = list(variables)
    dtype = dtype or upcast(*[v.dtype for v in variables])
    flat = [pt.cast(v, dtype).flatten() if v.dtype != dtype else v.flatten() for v in variables]
    return flat[0] if len(flat) == 1 else pt.concatenate(flat)


@_keyword_aliases(like="variables")
def unflatten_vars(flat_var, variables):
    """Slices of ``flat_var`` reshaped (and cast) like the current values of the shared
    ``variables`` (also accepted as ``like=``).  Returns a list, one per variable."""
    out, start = [], 0
    for v in variables:
        val = v.get_value(borrow=True)
        stop = start + val.size
        piece = flat_var[start:stop].reshape(val.shape, ndim=val.ndim)
        out.append(_cast_like(piece, v))
        start = stop
    return out


def _grads(loss_or_grads, params):
    if isinstance(loss_or_grads, (list, tuple)):          # gradients given, as in Lasagne
        grads = list(loss_or_grads)
        if len(grads) != len(params):
            raise ValueError(f"got {len(grads)} gradients for {len(params)} parameters")
        return grads
    return pytensor.grad(loss_or_grads, params)


@_keyword_aliases(loss_or_grads="loss")
def flat_unflat_grads(loss, params):
    """``(grad_shared, flat_grad, grads)``: the flat shared gradient vector (zeros, dtype of
    the params, named ``flat_grad_s``), the symbolic concatenated gradient, and
    per-parameter gradients read from ``grad_shared`` (what parameter updates use, after
    the all-reduce).  ``loss`` (also accepted as ``loss_or_grads=``): a scalar loss, or a
    list of gradient expressions (one per parameter)."""
    params = check_params(params)
    dtype = upcast(*[p.dtype for p in params])
    flat_grad = flatten_vars(_grads(loss, params), dtype)
    grad_shared = pytensor.shared(np.zeros(vars_flat_size(params), dtype=dtype), name="flat_grad_s")
    return grad_shared, flat_grad, unflatten_vars(grad_shared, params)


@_keyword_aliases(loss_or_grads="loss")
def nonflat_grads(loss, params):
    """``(grads_shared, grads)``: one gradient shared variable per parameter (zeros, shaped
    and typed like it, named ``<param>_grad``) and the symbolic gradients, in the order of
    ``params``.  The gradient function's updates are ``list(zip(grads_shared, grads))``;
    ``synk.all_reduce(grads_shared)`` then makes one collective per parameter (the flat
    vector of ``flat_unflat_grads`` needs only one).  ``loss`` (also ``loss_or_grads=``):
    a scalar loss, or a list of gradient expressions."""
    params = check_params(params)
    grads = [_cast_like(g, p) for g, p in zip(_grads(loss, params), params)]
    grads_shared = [_state_like(p, "grad") for p in params]
    return grads_shared, grads


class Reduced(list):
    """Gradients already reduced over the ranks, one expression per parameter: a rule given
    ``Reduced([g, ...])`` in place of the loss reads them directly and makes no gradient
    shared variable (its ``grad_updates`` are empty, its ``grad_shared`` None).  Sharded
    updates (``synkhronos.extensions.sharded``) pass each rank's block of the averaged flat
    gradient this way."""


def _prepare(loss, params):
    params = check_params(params)
    if isinstance(loss, Reduced):
        grads = [_cast_like(g, p) for g, p in zip(_grads(list(loss), params), params)]
        return params, grads, [], None
    grad_shared, flat_grad, grads = flat_unflat_grads(loss, params)
    return params, grads, [(grad_shared, flat_grad)], grad_shared


# ------------------------------------------------------------------------------------------
# Momentum (apply to any list of parameter updates)


def _momentum_params(fname, updates, params, momentum):
    # Lasagne's signature is (updates, params=None, momentum=0.9); the original synkhronos
    # took (param_updates, momentum=0.9): a scalar in second place is the momentum (a
    # number, a symbolic scalar, or a 0-d shared variable that is not updated itself).
    pairs = _as_pairs(updates)
    if params is not None and not isinstance(params, (list, tuple)):
        targets = {id(p) for p, _ in pairs}
        if not isinstance(params, SharedVariable) or (params.ndim == 0 and id(params) not in targets):
            if momentum is not _MOMENTUM:
                raise TypeError(f"{fname}() got the momentum twice: {params!r} in second place "
                                "(the original synkhronos' position) and momentum=")
            params, momentum = None, params
    if params is None:
        params = [p for p, _ in pairs]
    elif isinstance(params, SharedVariable):
        params = [params]
    return pairs, list(params), momentum


@_keyword_aliases(param_updates="updates")
def apply_momentum(updates, params=None, momentum=_MOMENTUM):
    """Add classical momentum to parameter ``updates`` (list of pairs or dict; also
    accepted as ``param_updates=``): for each param, ``x = momentum * velocity +
    updates[param]``, ``velocity <- x - param``, ``param <- x``.  ``params`` (default: all
    updated variables) selects which.  The original synkhronos' form
    ``apply_momentum(param_updates, momentum)`` works too: a scalar in second place is the
    momentum.  Returns a new list of pairs."""
    pairs, params, momentum = _momentum_params("apply_momentum", updates, params, momentum)
    new = OrderedDict(pairs)
    for p in params:
        if p not in new:
            raise ValueError(f"parameter {p} has no update to apply momentum to")
        m = _const(float(momentum) if type(momentum) is _Default else momentum, p.dtype)
        velocity = _state_like(p, "velocity")
        x = _cast_like(m * velocity + new[p], p)
        new[velocity] = _cast_like(x - p, p)
        new[p] = x
    return list(new.items())


@_keyword_aliases(param_updates="updates")
def apply_nesterov_momentum(updates, params=None, momentum=_MOMENTUM):
    """Add Nesterov momentum to parameter ``updates`` (also ``param_updates=``): for each
    param, ``x = momentum * velocity + updates[param] - param``, ``velocity <- x``,
    ``param <- momentum * x + updates[param]``.  Arguments as for ``apply_momentum``.
    Returns a new list of pairs."""
    pairs, params, momentum = _momentum_params("apply_nesterov_momentum", updates, params, momentum)
    new = OrderedDict(pairs)
    for p in params:
        if p not in new:
            raise ValueError(f"parameter {p} has no update to apply momentum to")
        m = _const(float(momentum) if type(momentum) is _Default else momentum, p.dtype)
        velocity = _state_like(p, "velocity")
        x = _cast_like(m * velocity + new[p] - p, p)
        new[velocity] = x
        new[p] = _cast_like(m * x + new[p], p)
    return list(new.items())


# ------------------------------------------------------------------------------------------
# Rules: each returns (grad_updates, param_updates, grad_shared)


@_keyword_aliases(loss_or_grads="loss")
def sgd(loss, params, learning_rate):
    """Stochastic gradient descent: ``param <- param - learning_rate * grad``."""
    params, grads, grad_updates, grad_shared = _prepare(loss, params)
    param_updates = []
    for p, g in zip(params, grads):
        lr = _const(learning_rate, p.dtype)
        param_updates.append((p, _cast_like(p - lr * g, p)))
    return grad_updates, param_updates, grad_shared


@_keyword_aliases(loss_or_grads="loss")
def momentum(loss, params, learning_rate, momentum=0.9):
    """SGD with classical momentum (``sgd`` then ``apply_momentum``)."""
    grad_updates, param_updates, grad_shared = sgd(loss, params, learning_rate)
    return grad_updates, apply_momentum(param_updates, momentum=momentum), grad_shared


@_keyword_aliases(loss_or_grads="loss")
def nesterov_momentum(loss, params, learning_rate, momentum=0.9):
    """SGD with Nesterov momentum (``sgd`` then ``apply_nesterov_momentum``)."""
    grad_updates, param_updates, grad_shared = sgd(loss, params, learning_rate)
    return grad_updates, apply_nesterov_momentum(param_updates, momentum=momentum), grad_shared


@_keyword_aliases(loss_or_grads="loss")
def adagrad(loss, params, learning_rate=1.0, epsilon=1e-6):
    """Adagrad: ``accu <- accu + grad**2``, ``param <- param - lr * grad / sqrt(accu + eps)``."""
    params, grads, grad_updates, grad_shared = _prepare(loss, params)
    param_updates = []
    for p, g in zip(params, grads):
        lr, eps = _const(learning_rate, p.dtype), _const(epsilon, p.dtype)
        accu = _state_like(p, "accu")
        accu_new = _cast_like(accu + g ** 2, p)
        param_updates.append((accu, accu_new))
        param_updates.append((p, _cast_like(p - lr * g / pt.sqrt(accu_new + eps), p)))
    return grad_updates, param_updates, grad_shared


@_keyword_aliases(loss_or_grads="loss")
def rmsprop(loss, params, learning_rate=1.0, rho=0.9, epsilon=1e-6):
    """RMSProp: ``accu <- rho * accu + (1 - rho) * grad**2``,
    ``param <- param - lr * grad / sqrt(accu + eps)``."""
    params, grads, grad_updates, grad_shared = _prepare(loss, params)
    param_updates = []
    for p, g in zip(params, grads):
        lr, r, eps = (_const(v, p.dtype) for v in (learning_rate, rho, epsilon))
        one = _const(1, p.dtype)
        accu = _state_like(p, "accu")
        accu_new = _cast_like(r * accu + (one - r) * g ** 2, p)
        param_updates.append((accu, accu_new))
        param_updates.append((p, _cast_like(p - lr * g / pt.sqrt(accu_new + eps), p)))
    return grad_updates, param_updates, grad_shared


@_keyword_aliases(loss_or_grads="loss")
def adadelta(loss, params, learning_rate=1.0, rho=0.95, epsilon=1e-6):
    """Adadelta: ``accu <- rho * accu + (1 - rho) * grad**2``,
    ``step = grad * sqrt(delta_accu + eps) / sqrt(accu + eps)``, ``param <- param - lr * step``,
    ``delta_accu <- rho * delta_accu + (1 - rho) * step**2``."""
    params, grads, grad_updates, grad_shared = _prepare(loss, params)
    param_updates = []
    for p, g in zip(params, grads):
        lr, r, eps = (_const(v, p.dtype) for v in (learning_rate, rho, epsilon))
        one = _const(1, p.dtype)
        accu = _state_like(p, "accu")
        delta_accu = _state_like(p, "delta_accu")
        accu_new = _cast_like(r * accu + (one - r) * g ** 2, p)
        step = g * pt.sqrt(delta_accu + eps) / pt.sqrt(accu_new + eps)
        param_updates.append((accu, accu_new))
        param_updates.append((p, _cast_like(p - lr * step, p)))
        param_updates.append((delta_accu, _cast_like(r * delta_accu + (one - r) * step ** 2, p)))
    return grad_updates, param_updates, grad_shared


def _time_step(dtype):
    """Adam's step counter: ``(t_prev, t)`` with ``t = t_prev + 1`` (updated once per step)."""
    t_prev = pytensor.shared(np.asarray(0, dtype=dtype), name="t_prev")
    return t_prev, t_prev + _const(1, dtype)


@_keyword_aliases(loss_or_grads="loss")
def adam(loss, params, learning_rate=0.001, beta1=0.9, beta2=0.999, epsilon=1e-8):
    """Adam: ``m <- b1 m + (1 - b1) g``, ``v <- b2 v + (1 - b2) g**2``,
    ``param <- param - lr sqrt(1 - b2**t) / (1 - b1**t) * m / (sqrt(v) + eps)``."""
    params, grads, grad_updates, grad_shared = _prepare(loss, params)
    t_prev, t = _time_step(upcast(*[p.dtype for p in params]))
    param_updates = []
    for p, g in zip(params, grads):
        dt = p.dtype
        lr, b1, b2, eps = (_const(v, dt) for v in (learning_rate, beta1, beta2, epsilon))
        one, tt = _const(1, dt), _cast_like(t, p)
        a_t = lr * pt.sqrt(one - b2 ** tt) / (one - b1 ** tt)
        m_prev, v_prev = _state_like(p, "m"), _state_like(p, "v")
        m_t = _cast_like(b1 * m_prev + (one - b1) * g, p)
        v_t = _cast_like(b2 * v_prev + (one - b2) * g ** 2, p)
        param_updates.append((m_prev, m_t))
        param_updates.append((v_prev, v_t))
        param_updates.append((p, _cast_like(p - a_t * m_t / (pt.sqrt(v_t) + eps), p)))
    param_updates.append((t_prev, t))      # once, whatever the number of parameters
    return grad_updates, param_updates, grad_shared


@_keyword_aliases(loss_or_grads="loss")
def adamax(loss, params, learning_rate=0.002, beta1=0.9, beta2=0.999, epsilon=1e-8):
    """Adamax: ``m <- b1 m + (1 - b1) g``, ``u <- max(b2 u, |g|)``,
    ``param <- param - lr / (1 - b1**t) * m / (u + eps)``."""
    params, grads, grad_updates, grad_shared = _prepare(loss, params)
    t_prev, t = _time_step(upcast(*[p.dtype for p in params]))
    param_updates = []
    for p, g in zip(params, grads):
        dt = p.dtype
        lr, b1, b2, eps = (_const(v, dt) for v in (learning_rate, beta1, beta2, epsilon))
        one, tt = _const(1, dt), _cast_like(t, p)
        a_t = lr / (one - b1 ** tt)
        m_prev, u_prev = _state_like(p, "m"), _state_like(p, "u")
        m_t = _cast_like(b1 * m_prev + (one - b1) * g, p)
        u_t = _cast_like(pt.maximum(b2 * u_prev, abs(g)), p)
        param_updates.append((m_prev, m_t))
        param_updates.append((u_prev, u_t))
        param_updates.append((p, _cast_like(p - a_t * m_t / (u_t + eps), p)))
    param_updates.append((t_prev, t))
    return grad_updates, param_updates, grad_shared


@_keyword_aliases(loss_or_grads="loss")
def sgd_nonflat(loss, params, learning_rate):
    """SGD with one gradient shared variable per parameter (``nonflat_grads``) instead of
    the flat vector: ``grad_shared`` is a list, all-reduced as a list (one collective per
    parameter).  The original kept it to measure what flattening gains."""
    params = check_params(params)
    grads_shared, grads = nonflat_grads(loss, params)
    grad_updates = list(zip(grads_shared, grads))
    param_updates = [(p, _cast_like(p - _const(learning_rate, p.dtype) * g, p))
                     for p, g in zip(params, grads_shared)]
    return grad_updates, param_updates, grads_shared
