"""All-reduce of float32 shared variables sent as float16 (Theano-MPI's "asa16"), with
optional error feedback: ``Fp16AllReduce``, and ``prepare`` / ``all_reduce`` in the shape of
``synk.all_reduce``.  What each rank does is ``fp16_rank``."""
import numpy as np
import pytensor
from pytensor.compile.sharedvalue import SharedVariable

import synkhronos as synk
from synkhronos.reductions import OPS, check_mode
from synkhronos.session import get_session

from .common import as_list, before_distribute, register_variables, shared_id
from .fp16_rank import COMMAND, fp16_all_reduce

_PREPARED = []            # every Fp16AllReduce of the open sessions (for all_reduce())


class Fp16AllReduce:
    """All-reduce of float32 shared variables sent as float16, with optional error feedback.

    Make it before ``synk.distribute()``: it adds, per variable, a float16 *shadow* (what is
    sent) and, with ``error_feedback``, a float32 *residual* (what rounding lost, per rank).
    Call it (``ar(op="avg")``) once distributed: one command.  ``steps(op)`` gives the same
    exchange as follow-up steps of a call (``replica.follow_up``).

    Error feedback: each rank sends ``float16(value + residual)`` and keeps
    ``residual = value + residual - float32(sent)``.  Without it every exchange rounds each
    value to float16 (relative error <= 2**-11, values below 3e-8 vanish); with it, what one
    exchange loses is sent by the next, so sums over many exchanges (of gradients: the
    parameters' total change) stay within one rounding of the exact sum.  The result itself
    is rounded once more to float16 (the reduction is in float32)."""

    def __init__(self, variables, error_feedback=True, name="fp16"):
        session = before_distribute("Fp16AllReduce")
        vs = as_list(variables)
        if not vs:
            raise ValueError("no variables given")
        for v in vs:
            if not isinstance(v, SharedVariable):
                raise TypeError(f"fp16 all_reduce works on shared variables, got {v!r}")
            if v.type.dtype != "float32":
                raise TypeError(f"fp16 compression is for float32 values; {v} has dtype {v.type.dtype}")
        if len({id(v) for v in vs}) != len(vs):
            raise ValueError("the same variable was given more than once")
        self.variables = vs
        self.error_feedback = bool(error_feedback)
        self.shadows, self.residuals = [], []
        for v in vs:
            shape = np.shape(v.get_value(borrow=True))
            self.shadows.append(pytensor.shared(np.zeros(shape, np.float16), name=f"{v.name or 'var'}_fp16"))
            if self.error_feedback:
                self.residuals.append(pytensor.shared(np.zeros(shape, np.float32),
                                                      name=f"{v.name or 'var'}_fp16_residual"))
        self._reg = register_variables(f"{name}_register", vs + self.shadows + self.residuals)
        self._session = session
        _PREPARED[:] = [a for a in _PREPARED if not a._session.closed] + [self]

    def _items(self, session, variables=None):
        chosen = None if variables is None else {id(v) for v in variables}
        items = []
        for i, v in enumerate(self.variables):
            if chosen is not None and id(v) not in chosen:
                continue
            r = self.residuals[i] if self.error_feedback else None
            items.append((shared_id(session, v, "fp16 all_reduce"),
                          shared_id(session, self.shadows[i], "fp16 all_reduce"),
                          -1 if r is None else shared_id(session, r, "fp16 all_reduce")))
        return tuple(items)

    def steps(self, op="avg", variables=None):
        """The exchange as follow-up steps of a call: ``(("ext", ...),)``."""
        session = get_session(True)
        return (("ext", COMMAND, self._items(session, variables), _check_op(op)),)

    def __call__(self, op="avg", variables=None):
        """All-reduce (``avg`` or ``sum``) every variable (or ``variables``, a subset), in
        float16.  One command."""
        session = get_session(True)
        op = _check_op(op)
        with session.api(True):
            items = self._items(session, variables)
            me = session.me
            session.execute(COMMAND, (items, op), lambda: fp16_all_reduce(me, items, op),
                            what="fp16 all_reduce")
            session.commit()

    def reset_residuals(self):
        """Zero the residuals on every rank."""
        if self.residuals:
            synk.broadcast(self.residuals, [np.zeros(np.shape(r.get_value(borrow=True)), np.float32)
                                            for r in self.residuals])


def _check_op(op):
    op = check_mode(op, OPS, "reduce op")
    if op not in ("avg", "sum"):
        raise ValueError(f"fp16 all_reduce supports 'avg' and 'sum', got {op!r}")
    return op


def prepare(variables, compress="fp16", error_feedback=True):
    """Before ``synk.distribute()``: make what ``all_reduce(variables, compress=...)`` needs
    (an ``Fp16AllReduce``, returned)."""
    if compress != "fp16":
        raise ValueError(f"compress must be 'fp16', got {compress!r}")
    return Fp16AllReduce(variables, error_feedback=error_feedback)


def all_reduce(shared_vars, op="avg", compress=None, error_feedback=True):
    """``synk.all_reduce`` with optional compression: ``compress="fp16"`` sends float32 values
    as float16 (summed in float32), with or without error feedback.  The variables must
    have been prepared before ``synk.distribute()`` (``prepare`` or ``Fp16AllReduce`` with
    the same ``error_feedback``)."""
    vs = as_list(shared_vars)
    if compress is None:
        return synk.all_reduce(shared_vars, op=op)
    if compress != "fp16":
        raise ValueError(f"compress must be None or 'fp16', got {compress!r}")
    session = get_session(True)
    ef = bool(error_feedback)
    groups = {}
    for v in vs:
        for ar in reversed(_PREPARED):
            if ar._session is session and ar.error_feedback == ef and any(v is w for w in ar.variables):
                groups.setdefault(id(ar), (ar, []))[1].append(v)
                break
        else:
            raise RuntimeError(f"{v} was not prepared for compress='fp16' with error_feedback={ef}: call "
                               f"exchange.prepare(vars, compress='fp16', error_feedback={ef}) before "
                               "synk.distribute()")
    for ar, chosen in groups.values():
        ar(op, chosen)
