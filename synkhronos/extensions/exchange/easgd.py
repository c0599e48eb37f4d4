"""Elastic averaging SGD (``EASGD``, Theano-MPI's EASGD exchanger): ``tau`` local steps per
rank, then an elastic exchange with a center that every rank holds a bit-identical copy
of (reduced, not kept on the master: one balanced all-reduce per exchange)."""
import warnings

import numpy as np
import pytensor
import pytensor.tensor as pt

import synkhronos as synk
from synkhronos.function import call_then, compiled, replica_of
from synkhronos.session import get_session

from .. import strategies
from ..updates import flatten_vars, unflatten_vars
from .common import shared_id
from .local_step import LocalTrainFunction, local_parts


class EASGDTrainFunction(LocalTrainFunction):
    """The step of ``EASGD``: after every ``tau``-th local step, the elastic exchange (one
    command).  Attributes: ``tau``, ``alpha``, ``center`` (the flat center, a shared variable
    every rank holds a bit-identical copy of), ``exchanges`` (made so far)."""

    def __init__(self, f_local, params, state, inputs, spec, name):
        super().__init__(f_local, params, state, inputs)
        session = get_session()
        if int(spec.tau) < 1:
            raise ValueError(f"EASGD tau must be >= 1, got {spec.tau}")
        self.tau = int(spec.tau)
        self.alpha = 0.9 / session.n if spec.alpha is None else float(spec.alpha)
        if not 0 < self.alpha:
            raise ValueError(f"EASGD alpha must be positive, got {self.alpha}")
        if session.n * self.alpha >= 1:
            warnings.warn(f"EASGD: n * alpha = {session.n * self.alpha:g} >= 1: the center overshoots "
                          "(the exchange is stable for n * alpha < 1)", stacklevel=4)
        flat = flatten_vars(params)
        init = np.concatenate([np.asarray(p.get_value(), dtype=flat.dtype).reshape(-1) for p in params])
        self.center = pytensor.shared(init.copy(), name=f"{name}_easgd_center")
        self.buf = pytensor.shared(np.zeros_like(init), name=f"{name}_easgd_buf")
        a = pt.constant(np.asarray(self.alpha, dtype=flat.dtype))
        na = pt.constant(np.asarray(self.alpha * session.n, dtype=flat.dtype))
        centers = unflatten_vars(self.center, params)
        self.f_pre = synk.function([], updates=[(self.buf, flat)], name=f"{name}_easgd_pre")
        apply = [(p, pt.cast(p - a * (p - c), p.dtype)) for p, c in zip(params, centers)]
        apply.append((self.center, self.center + na * (self.buf - self.center)))
        self.f_apply = synk.function([], updates=apply, name=f"{name}_easgd_apply")
        self.state_vars.append(self.center)
        self.exchanges = 0

    def _after(self, t):
        if t % self.tau == 0:
            self.exchange()

    def exchange(self):
        """The elastic exchange now (every rank with the center): one command."""
        if compiled(self.f_apply):
            session = get_session(True)
            then = (("all_reduce", shared_id(session, self.buf, "EASGD"), "avg"),
                    ("run", replica_of(self.f_apply).fid))
            call_then(self.f_pre, (), {}, None, None, None, 1, then)
        else:                           # first time: each function compiles in the master first
            self.f_pre()
            synk.all_reduce(self.buf, op="avg")
            self.f_apply()
        self.exchanges += 1

    def center_givens(self):
        """``[(param, center's part)]``: givens that make a function compute with the
        center instead of the local parameters (e.g. to evaluate EASGD's result)."""
        return list(zip(self.params, unflatten_vars(self.center, self.params)))

    def reset_center(self):
        """The center becomes the master's parameters, on every rank."""
        flat = np.concatenate([np.asarray(p.get_value(), dtype=self.center.dtype).reshape(-1)
                               for p in self.params])
        synk.broadcast(self.center, flat)


def build(strategy, *args, name="train", **options):
    """``make_train_function`` with ``EASGD``."""
    return EASGDTrainFunction(*local_parts(*args, name=name, **options), strategy, name)


strategies.register(strategies.EASGD, build)
