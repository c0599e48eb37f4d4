"""Exchange strategies of the systems synkhronos replaces, built on its collectives.

=============================  =================================================================
``all_reduce(vars, compress=   Theano-MPI's BSP "asa16" exchange: float32 values sent as float16,
"fp16")`` / ``Fp16AllReduce``  summed in float32, optional error feedback (residuals per rank and
                               variable); in a training step: ``make_train_function(...,
                               compress="fp16")``
``EASGD(tau, alpha)``          elastic averaging (Theano-MPI's EASGD exchanger): ``tau`` local
                               steps per rank, then an elastic exchange with a center variable
``LocalSGD(k)``                local SGD: local steps, parameters averaged every ``k`` steps
``ParameterServer``            asynchronous parameter server (Inspur parallel Caffe): the master
                               applies each worker's gradient as it arrives and answers with the
                               newest weights; staleness bounded; a dead or slow worker is reported
                               and does not stall the others
=============================  =================================================================

Build everything after ``synk.fork()`` and before ``synk.distribute()`` (the exchanges make
functions and shared variables of their own)::

    from synkhronos.extensions import exchange, updates
    step = exchange.make_train_function(loss, params, [x, y], updates.sgd, learning_rate=0.1,
                                        exchange=exchange.EASGD(tau=4))
    synk.distribute()
    loss_value = step(x_data, y_data, batch=idx)

How each one runs (see ``docs/exchange.rst`` for when each helps, with measurements):

* **fp16**: one command per exchange (``Fp16AllReduce``), or chained in the training step's
  command (gradient, then the compressed all-reduce, then the update rule: one round trip).
  On every rank: ``shadow = float16(value [+ residual])`` (numba kernel,
  ``synkhronos.backends.half``; values beyond float16's range saturate to +-65504), the
  comm plane's all-reduce of the float16 shadows (summed in float32, rounded once to
  float16), ``value = float32(result)``.  With error feedback each rank keeps
  ``residual = (value + residual) - float32(shadow)``: what the rounding lost is sent with
  the next exchange instead of being lost (1-bit SGD, EF-SGD), so the sum of what was sent
  stays within one rounding of the sum of the values, however many exchanges.  PyTensor's
  numba backend has no float16, hence a rank-side step instead of compiled functions.
* **EASGD**: the center is *reduced*, not kept on the master: every rank holds an identical
  copy.  An exchange is one command: ``buf = flatten(params)`` on every rank,
  ``all_reduce(buf, "avg")``, then on every rank ``params -= alpha * (params - center)`` and
  ``center += alpha * n * (mean - center)`` (the sum over ranks of ``x_i - center``).  Every
  rank applies the same arithmetic to the same all-reduced bits, so the copies stay
  bit-identical; the exchange costs one balanced all-reduce (each rank reduces 1/n of the
  vector) instead of a gather into the master plus a broadcast back (2x the traffic, all
  through one process), and the master computes no more than the others.
* **local SGD**: each step runs the gradient *and* the update rule in one compiled function
  (no all-reduce); every ``k``-th step chains ``all_reduce(param, "avg")`` of every
  parameter in the same command.
* **parameter server**: one long command (``ParameterServer.run``); master and workers
  exchange through a channel (``backends.shm_channel``: shared memory inside a host; across
  hosts each host's agent relays its workers' messages over MPI, ``backends.mpi_channel``).

Also here: ``straggle(x, {rank: seconds})``, an identity op that sleeps on the given ranks
(to simulate a slow worker)."""
import sys
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import pytensor
import pytensor.tensor as pt
from pytensor.compile.sharedvalue import SharedVariable
from pytensor.graph.basic import Apply
from pytensor.graph.op import Op
from pytensor.graph.replace import clone_replace

import synkhronos as synk
from synkhronos import rank as _rank
from synkhronos.kernels import half
from synkhronos.commands import worker_command
from synkhronos.reductions import OPS, check_mode

from . import train as _train
from .updates import flatten_vars, unflatten_vars

__all__ = ["all_reduce", "prepare", "Fp16AllReduce", "Fp16", "EASGD", "LocalSGD", "make_train_function",
           "CompressedTrainFunction", "LocalTrainFunction", "EASGDTrainFunction", "LocalSGDTrainFunction",
           "ParameterServer", "PSResult", "straggle", "Straggle"]

_CMD = __name__ + ":"
CMD_FP16 = _CMD + "fp16"
CMD_PS = _CMD + "ps"
_REGISTRY = []            # every Fp16AllReduce of the open sessions (for all_reduce())


def _session(require_distributed=False):
    from synkhronos.session import get_session
    return get_session(require_distributed)


def _before_distribute(what):
    rt = _session()
    if rt.distributed:
        raise RuntimeError(f"{what} makes functions and shared variables of its own: build it after "
                           "synk.fork() and before synk.distribute()")
    return rt


def _as_list(v):
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _vid(rt, var, what):
    vid = rt.shared_ids.get(id(var))
    if vid is None:
        raise ValueError(f"{what}: {var} is not a shared variable of any distributed synkhronos function")
    return vid


def _register(name, variables):
    """A function that is never called (no JIT): it makes the variables known to the
    collectives (every shared variable of a function gets a registry index)."""
    return synk.function([], outputs=[pt.sum(v) for v in variables], name=name)


# ==========================================================================================
# fp16 all-reduce with error feedback


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
        rt = _before_distribute("Fp16AllReduce")
        vs = _as_list(variables)
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
        self._reg = _register(f"{name}_register", vs + self.shadows + self.residuals)
        self._rt = rt
        _REGISTRY[:] = [a for a in _REGISTRY if not a._rt.closed] + [self]

    def _items(self, rt, variables=None):
        chosen = None if variables is None else {id(v) for v in variables}
        items = []
        for i, v in enumerate(self.variables):
            if chosen is not None and id(v) not in chosen:
                continue
            r = self.residuals[i] if self.error_feedback else None
            items.append((_vid(rt, v, "fp16 all_reduce"), _vid(rt, self.shadows[i], "fp16 all_reduce"),
                          -1 if r is None else _vid(rt, r, "fp16 all_reduce")))
        return tuple(items)

    def steps(self, op="avg", variables=None):
        """The exchange as follow-up steps of a call: ``(("ext", ...),)``."""
        rt = _session(True)
        return (("ext", CMD_FP16, self._items(rt, variables), _check_op(op)),)

    def __call__(self, op="avg", variables=None):
        """All-reduce (``avg`` or ``sum``) every variable (or ``variables``, a subset), in
        float16.  One command."""
        rt = _session(True)
        op = _check_op(op)
        with rt.api(True):
            items = self._items(rt, variables)
            ctx = rt.me
            rt.execute(CMD_FP16, (items, op), lambda: _fp16_step(ctx, items, op), what="fp16 all_reduce")
            rt.commit()

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
    vs = _as_list(shared_vars)
    if compress is None:
        return synk.all_reduce(shared_vars, op=op)
    if compress != "fp16":
        raise ValueError(f"compress must be None or 'fp16', got {compress!r}")
    rt = _session(True)
    ef = bool(error_feedback)
    groups = {}
    for v in vs:
        for ar in reversed(_REGISTRY):
            if ar._rt is rt and ar.error_feedback == ef and any(v is w for w in ar.variables):
                groups.setdefault(id(ar), (ar, []))[1].append(v)
                break
        else:
            raise RuntimeError(f"{v} was not prepared for compress='fp16' with error_feedback={ef}: call "
                               f"exchange.prepare(vars, compress='fp16', error_feedback={ef}) before "
                               "synk.distribute()")
    for ar, chosen in groups.values():
        ar(op, chosen)


def _spare(state, key, current, shape, dtype):
    """One of two buffers kept for ``key`` on this rank: the one that is not ``current``
    (the variable's value now), so a new value never overwrites the one it replaces."""
    bufs = state.setdefault(key, [])
    for b in bufs:
        if b.shape == shape and b.dtype == dtype and b is not current and not np.may_share_memory(b, current):
            return b
    b = np.empty(shape, dtype)
    bufs.append(b)
    del bufs[:-2]
    return b


def _rank_state(ctx):
    st = ctx.extras.get("exchange")
    if st is None:
        st = ctx.extras["exchange"] = {}
    return st


@worker_command(CMD_FP16)
def _fp16_step(ctx, items, op):
    """Every rank: compress, all-reduce the float16 shadows (one comm call), decompress.
    Reads each variable's pending value (a follow-up reads what the call just computed);
    the results become pending (and the variables' values, for the next follow-up).
    A device rank (JAX) does the same on host copies of its values (the conversions are
    the host's numba kernels) and puts the results back on its device."""
    dev = ctx.device
    on_host = dev.placement == "host"
    st = _rank_state(ctx)
    work = []
    for vid, svid, rvid in items:
        var, svar = ctx.shareds[vid], ctx.shareds[svid]
        value = np.ascontiguousarray(dev.to_host(ctx.pending_value(var)))
        if value.dtype != np.float32:
            raise TypeError(f"fp16 all_reduce: {var} holds {value.dtype} values, expected float32")
        shape = value.shape
        # after the first exchange: the comm's slot (no copy-in)
        shadow = dev.get(svar) if on_host else st.get(("s", svid))
        if not (isinstance(shadow, np.ndarray) and shadow.dtype == np.float16 and shadow.shape == shape
                and shadow.flags.c_contiguous and shadow.flags.writeable):
            shadow = np.empty(shape, np.float16)
        rvar = r_new = None
        if rvid >= 0:
            rvar = ctx.shareds[rvid]
            r = dev.get(rvar) if on_host else np.asarray(dev.to_host(dev.get(rvar)))
            if not (isinstance(r, np.ndarray) and r.dtype == np.float32 and r.shape == shape):
                r = np.zeros(shape, np.float32)          # a new shape: start afresh
            r_new = _spare(st, ("r", rvid), r, shape, np.float32)
            half.compress(value, shadow, np.ascontiguousarray(r), r_new)
        else:
            half.compress(value, shadow)
        work.append((var, svar, svid, rvar, r_new, shadow, shape, vid))
    comm = ctx.comm.pick("all_reduce", np.float16, op, "host")     # shadows are host arrays
    results = comm.all_reduce([(svid, shadow) for _, _, svid, _, _, shadow, _, _ in work], op, fence=True)
    held = {}
    for (var, svar, svid, rvar, r_new, _, shape, vid), res in zip(work, results):
        out = _spare(st, ("v", vid), dev.get(var) if on_host else None, shape, np.float32)
        half.decompress(np.asarray(res), out)
        if on_host:
            held[svar] = res
        else:                         # the shadow stays on the host (internal: no copy to the device)
            st[("s", svid)] = res
            out = dev.to_device(out)                                 # (copies)
            r_new = None if rvar is None else dev.to_device(r_new)
        dev.set(var, out)             # a follow-up step of this command reads it
        held[var] = out
        if rvar is not None:
            held[rvar] = r_new
    ctx.hold(ctx.seq, held)
    return None


# ==========================================================================================
# straggle: an identity op that sleeps on chosen ranks


class Straggle(Op):
    """``straggle(x, {rank: seconds})``: ``x`` unchanged; computing it sleeps ``seconds`` on
    those ranks (inside a synkhronos call; never in plain PyTensor use).  For tests and
    demos of slow workers."""

    __props__ = ("delays",)
    view_map = {0: [0]}

    def __init__(self, delays):
        self.delays = tuple(sorted((int(r), float(s)) for r, s in dict(delays).items()))

    def make_node(self, x):
        x = pt.as_tensor_variable(x)
        return Apply(self, [x], [x.type()])

    def perform(self, node, inputs, outputs):
        _straggle_sleep(self.delays)
        outputs[0][0] = inputs[0]

    def pullback(self, inputs, outputs, output_grads):
        return [output_grads[0]]

    def infer_shape(self, *args):      # (node, shapes); older PyTensor: (fgraph, node, shapes)
        return [args[-1][0]]


def _straggle_sleep(delays):
    r = _rank.current()
    if r is None:
        return
    for rank, seconds in delays:
        if rank == r.rank and seconds > 0:
            time.sleep(seconds)


def straggle(x, delays):
    """``x``, computed ``delays[rank]`` seconds late on the given ranks (see ``Straggle``)."""
    _register_straggle_jax(importing=True)
    return Straggle(delays)(x)


def _register_straggle_numba():
    try:
        import numba
        from pytensor.link.numba.dispatch.basic import register_funcify_default_op_cache_key
    except ImportError:          # pragma: no cover - the other backends call perform
        return

    @register_funcify_default_op_cache_key(Straggle)
    def numba_funcify_straggle(op, node, **kwargs):
        delays = op.delays

        def straggle_impl(x):
            with numba.objmode():
                _straggle_sleep(delays)
            return x
        from pytensor.link.numba.dispatch.basic import numba_njit
        return numba_njit(straggle_impl), 1


_register_straggle_numba()
_jax_registered = False


def _register_straggle_jax(importing=False):
    """Straggle for PyTensor's JAX backend: a host callback that sleeps.  Registered when
    JAX is already loaded (a JAX rank unpickling a graph) or when a graph uses straggle
    (``importing``: JAX is loaded then, if installed)."""
    global _jax_registered
    if _jax_registered or not (importing or "jax" in sys.modules):
        return
    try:
        import jax
        from pytensor.link.jax.dispatch import jax_funcify
    except ImportError:
        return
    _jax_registered = True

    @jax_funcify.register(Straggle)
    def jax_funcify_straggle(op, **kwargs):
        delays = op.delays

        def sleep_then(x):
            _straggle_sleep(delays)
            return x

        def straggle_impl(x):
            return jax.pure_callback(sleep_then, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return straggle_impl


_register_straggle_jax()


# ==========================================================================================
# Training steps


@dataclass(frozen=True)
class Fp16:
    """Synchronous (BSP) training with the gradient all-reduced in float16."""
    error_feedback: bool = True


@dataclass(frozen=True)
class EASGD:
    """Elastic averaging SGD: ``tau`` local steps per rank, then an elastic exchange of
    strength ``alpha`` with the center (default ``0.9 / n``: the paper's beta = n alpha = 0.9;
    keep ``n * alpha < 1``)."""
    tau: int = 4
    alpha: float = None


@dataclass(frozen=True)
class LocalSGD:
    """Local SGD: local steps, parameters averaged over the ranks every ``k`` steps
    (``also``: more shared variables averaged with them, e.g. the update rule's state)."""
    k: int = 8
    also: tuple = ()


def _strategy(exchange, compress, error_feedback):
    if compress is not None:
        if compress != "fp16":
            raise ValueError(f"compress must be None or 'fp16', got {compress!r}")
        if exchange not in (None, "bsp", "fp16") and not isinstance(exchange, Fp16):
            raise ValueError("compress='fp16' applies to the synchronous (BSP) step; give one of "
                             "compress= or exchange=")
        return Fp16(error_feedback)
    if exchange is None or exchange == "bsp":
        return None
    if exchange == "fp16":
        return Fp16(error_feedback)
    if exchange == "easgd":
        return EASGD()
    if exchange == "local":
        return LocalSGD()
    if isinstance(exchange, (Fp16, EASGD, LocalSGD)):
        return exchange
    raise ValueError(f"exchange must be 'bsp', 'fp16', 'easgd', 'local' or an Fp16/EASGD/LocalSGD, "
                     f"got {exchange!r}")


def make_train_function(loss, params, inputs=None, *args, update_rule=None, x=None, y=None,
                        bcast_inputs=None, givens=None, sliceable_shareds=None, name="train",
                        exchange=None, compress=None, error_feedback=True, **kwargs):
    """``train.make_train_function`` with an exchange strategy: ``exchange`` is ``"bsp"``
    (the default: ``train.make_train_function`` itself), ``"fp16"`` or ``Fp16(...)``
    (float16 gradient all-reduce; also ``compress="fp16"``), ``EASGD(tau, alpha)`` or
    ``LocalSGD(k)``.  Other arguments as for ``train.make_train_function``.  Returns a
    callable step: ``step(*data, batch=None, num_slices=1, **call_kwargs) -> loss``."""
    strategy = _strategy(exchange, compress, error_feedback)
    common = dict(bcast_inputs=bcast_inputs, givens=givens, sliceable_shareds=sliceable_shareds, name=name)
    if strategy is None:
        return _train.make_train_function(loss, params, inputs, *args, update_rule=update_rule, x=x, y=y,
                                          **common, **kwargs)
    _before_distribute("an exchange strategy")
    if isinstance(strategy, Fp16):
        base = _train.make_train_function(loss, params, inputs, *args, update_rule=update_rule, x=x, y=y,
                                          **common, **kwargs)
        grads = _as_list(base.grad_shared)
        return CompressedTrainFunction(base, Fp16AllReduce(grads, strategy.error_feedback, name=f"{name}_fp16"))
    in_vars, rule, rest = _train._parse_form("make_train_function", inputs, args, update_rule, x, y)
    grad_updates, param_updates, grad_shared = rule(loss, params, *rest, **kwargs)
    f_local = _local_step(loss, in_vars, grad_updates, param_updates, grad_shared, common)
    params = _as_list(params)
    state = [v for v, _ in param_updates]
    all_inputs = in_vars + _as_list(bcast_inputs or [])
    if isinstance(strategy, EASGD):
        return EASGDTrainFunction(f_local, params, state, all_inputs, strategy, name)
    return LocalSGDTrainFunction(f_local, params, state, all_inputs, strategy)


def _local_step(loss, in_vars, grad_updates, param_updates, grad_shared, common):
    """One compiled function: this rank's gradient on its rows, then the update rule with
    it (the gradient shared variable replaced by its expression: no all-reduce)."""
    targets = {id(g) for g in _as_list(grad_shared)}
    replace = {g: e for g, e in grad_updates if id(g) in targets}
    extra = [(v, e) for v, e in grad_updates if id(v) not in targets]       # e.g. batch-norm statistics
    exprs = clone_replace([e for _, e in param_updates], replace=replace)
    ups = list(zip([v for v, _ in param_updates], exprs)) + extra
    return synk.function(in_vars, outputs=loss, bcast_inputs=common["bcast_inputs"], updates=ups,
                         givens=common["givens"], sliceable_shareds=common["sliceable_shareds"],
                         name=f"{common['name']}_local")


class CompressedTrainFunction(_train.TrainFunction):
    """A BSP training step whose gradient is all-reduced in float16 (``Fp16AllReduce``):
    gradient, compressed all-reduce and update rule in one command.  Attributes as
    ``TrainFunction``, plus ``compressor``.  ``restore`` also zeroes the residuals (they
    are per rank: a snapshot of the master's would not fit the others).  ``serial`` is the
    uncompressed single-process step."""

    def __init__(self, base, compressor):
        super().__init__(base.grad_function, base.update_function, base.grad_shared, base.params,
                         base.grad_updates, base.param_updates, base.inputs)
        self.compressor = compressor

    def restore(self, values):
        super().restore(values)
        if _session().distributed:      # (before, the residuals are zeros anyway)
            self.compressor.reset_residuals()

    def _chain(self):
        rt = _session()
        if not rt.distributed:
            return ()
        return self.compressor.steps("avg") + (("run", self.update_function._replica.fid),)

    def _exchange(self):
        self.compressor("avg")


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
        return ()

    def _after(self, t):
        pass

    def __call__(self, *data, batch=None, num_slices=1, **call_kwargs):
        data, call_kwargs = _train._legacy_data_names("the training step", self.inputs, data, call_kwargs)
        output_subset = call_kwargs.pop("output_subset", None)
        batch_s = call_kwargs.pop("batch_s", None)
        t = self.t + 1
        loss = self.local_function._invoke(data, call_kwargs, output_subset, batch, batch_s, num_slices,
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


class LocalSGDTrainFunction(LocalTrainFunction):
    """The step of ``LocalSGD``: every ``k``-th step also averages the parameters (and the
    variables of ``also``: ``averaged``) over the ranks, chained in the step's command."""

    def __init__(self, f_local, params, state, inputs, spec):
        super().__init__(f_local, params, state, inputs)
        if int(spec.k) < 1:
            raise ValueError(f"LocalSGD k must be >= 1, got {spec.k}")
        self.k = int(spec.k)
        self.averaged = list(params) + [v for v in spec.also if all(v is not p for p in params)]
        self._reg = _register("local_sgd_register", self.averaged) if spec.also else None

    def _then(self, t):
        if t % self.k:
            return ()
        rt = _session(True)
        return tuple(("all_reduce", _vid(rt, v, "LocalSGD"), "avg") for v in self.averaged)

    def average(self):
        """Average the parameters over the ranks now."""
        synk.all_reduce(self.averaged, op="avg")


class EASGDTrainFunction(LocalTrainFunction):
    """The step of ``EASGD``: after every ``tau``-th local step, the elastic exchange (one
    command).  Attributes: ``tau``, ``alpha``, ``center`` (the flat center, a shared variable
    every rank holds a bit-identical copy of), ``exchanges`` (made so far)."""

    def __init__(self, f_local, params, state, inputs, spec, name):
        super().__init__(f_local, params, state, inputs)
        rt = _session()
        if int(spec.tau) < 1:
            raise ValueError(f"EASGD tau must be >= 1, got {spec.tau}")
        self.tau = int(spec.tau)
        self.alpha = 0.9 / rt.n if spec.alpha is None else float(spec.alpha)
        if not 0 < self.alpha:
            raise ValueError(f"EASGD alpha must be positive, got {self.alpha}")
        if rt.n * self.alpha >= 1:
            warnings.warn(f"EASGD: n * alpha = {rt.n * self.alpha:g} >= 1: the center overshoots "
                          "(the exchange is stable for n * alpha < 1)", stacklevel=3)
        flat = flatten_vars(params)
        init = np.concatenate([np.asarray(p.get_value(), dtype=flat.dtype).reshape(-1) for p in params])
        self.center = pytensor.shared(init.copy(), name=f"{name}_easgd_center")
        self.buf = pytensor.shared(np.zeros_like(init), name=f"{name}_easgd_buf")
        a = pt.constant(np.asarray(self.alpha, dtype=flat.dtype))
        na = pt.constant(np.asarray(self.alpha * rt.n, dtype=flat.dtype))
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
        if self.f_apply._warm:
            rt = _session(True)
            then = (("all_reduce", _vid(rt, self.buf, "EASGD"), "avg"), ("run", self.f_apply._replica.fid))
            self.f_pre._invoke((), {}, None, None, None, 1, then)
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


# ==========================================================================================
# Asynchronous parameter server


@dataclass
class PSResult:
    """What ``ParameterServer.run`` did.

    ``applied``: gradients applied (the server's updates); ``dropped``: gradients staler
    than ``max_staleness`` (answered with fresh weights, not applied); ``version``: the
    server's update count after the run (across runs); ``seconds``: wall time of the run;
    ``per_rank``: rank -> ``{"sent", "applied", "dropped", "max_staleness",
    "mean_staleness"}``; ``staleness``: every applied gradient's staleness (updates made
    by others between the weights it was computed on and its own); ``dead`` / ``slow``:
    ``(rank, seconds into the run, what)`` of the workers reported; ``events``:
    ``(seconds, version, rank, staleness, loss, applied)`` per gradient received."""
    applied: int = 0
    dropped: int = 0
    version: int = 0
    seconds: float = 0.0
    per_rank: dict = field(default_factory=dict)
    staleness: list = field(default_factory=list)
    dead: list = field(default_factory=list)
    slow: list = field(default_factory=list)
    events: list = field(default_factory=list)
    workers: dict = field(default_factory=dict)

    @property
    def max_staleness(self):
        return max(self.staleness) if self.staleness else 0


class ParameterServer:
    """Asynchronous training with the master as parameter server (Inspur parallel Caffe,
    Downpour SGD).  Build before ``synk.distribute()``::

        ps = ParameterServer(loss, params, [x, y], updates.sgd, learning_rate=0.05)
        synk.distribute()
        result = ps.run(X_data, y_data, steps=1000, batch_size=32)

    ``run`` is one long command.  Each worker (every rank but the master) loops: take the
    newest weights, compute the gradient of ``loss`` on ``batch_size`` rows of its own
    shard of the data (rows split over the workers, shuffled each pass, seeded by
    ``seed`` and the rank), send it, wait for the answer.  The master serves: it applies
    each gradient as it arrives with the update rule (its state lives in the master) and
    answers with the current weights, round-robin over the workers with a message.  A
    gradient computed on weights more than ``max_staleness`` updates old is dropped (the
    worker gets fresh weights), so every applied gradient's staleness is within the bound.
    Workers never wait for each other: a slow worker only delays itself (and is reported
    once it has sent nothing for ``slow_after`` seconds); a dead one is reported and
    skipped, the run goes on with the others, and ``run`` then raises ``WorkerDied`` (the
    session is closed: it cannot run lockstep commands without that rank), with the run's
    ``PSResult`` as its ``ps_result``.  A worker whose computation raises ends the run at
    once (most likely every worker would): ``run`` gives every rank the server's weights,
    then raises ``WorkerError`` naming it (with ``ps_result``); the session goes on.

    The master only serves (it computes no gradients), so n ranks give n - 1 computing
    workers.  On one host master and workers exchange through shared memory; under
    ``mpiexec`` (several hosts) the workers of another host exchange through their host's
    agent, which relays each gradient to the master and each answer back over MPI (once
    per message, no pickling), with the same guarantees: staleness within the bound, a
    slow, dead or frozen worker on any host reported (``WorkerDied`` / ``WorkerStopped``
    naming rank and host) without stalling the others."""

    def __init__(self, loss, params, inputs, update_rule, *args, max_staleness=None, name="ps", **kwargs):
        rt = _before_distribute("ParameterServer")
        self.params = _as_list(params)
        self.inputs = _as_list(inputs)
        grad_updates, param_updates, grad_shared = update_rule(loss, self.params, *args, **kwargs)
        if isinstance(grad_shared, (list, tuple)):
            raise TypeError("ParameterServer needs a rule with one flat gradient vector (updates.sgd, "
                            "adam, ...), not sgd_nonflat")
        flat = [e for v, e in grad_updates if v is grad_shared]
        if len(grad_updates) != 1 or not flat:
            raise TypeError("ParameterServer: the rule's gradient function may only write the flat "
                            "gradient (no other updates such as batch-norm statistics)")
        self.grad_shared = grad_shared
        self.dtype = np.dtype(grad_shared.type.dtype)
        self.size = int(grad_shared.get_value(borrow=True).size)
        self.grad_function = synk.function(self.inputs, outputs=[loss, flat[0]], name=f"{name}_grad")
        self.update_function = synk.function([], updates=param_updates, name=f"{name}_update")
        self.n_workers = rt.n - 1
        self.max_staleness = max(1, 2 * self.n_workers) if max_staleness is None else int(max_staleness)
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.version = 0
        self.last_result = None
        self._warm = False

    def _check(self, rt, steps, max_seconds, batch_size, datas):
        if rt.n < 2:
            raise ValueError("ParameterServer.run needs at least one worker besides the master: fork(2) or more")
        if steps is None and max_seconds is None:
            raise ValueError("give steps (gradients to apply) or max_seconds")
        if steps is not None and (isinstance(steps, bool) or int(steps) < 1):
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        if isinstance(batch_size, bool) or int(batch_size) < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if len(datas) != len(self.inputs):
            raise TypeError(f"run takes {len(self.inputs)} data inputs, got {len(datas)}")
        lengths = {len(d) for d in datas}
        if len(lengths) != 1:
            raise ValueError(f"the data inputs have different lengths {sorted(lengths)}")
        n_rows = lengths.pop()
        shard = n_rows // self.n_workers
        if shard < int(batch_size):
            raise ValueError(f"each of the {self.n_workers} workers gets {shard} rows of the data, fewer than "
                             f"batch_size={batch_size}")
        return n_rows

    def run(self, *data, steps=None, batch_size=32, max_seconds=None, seed=0, slow_after=10.0, sync=True,
            verbose=True):
        """Train until ``steps`` gradients are applied (or ``max_seconds`` pass); returns a
        ``PSResult``.  ``data``: one ``synk.Data`` (or array) per input, rows along axis 0.
        With ``sync`` the master's final weights are broadcast to every rank afterwards."""
        rt = _session(True)
        datas = [d if isinstance(d, synk.Data) else synk.data(np.asarray(d), var=v)
                 for d, v in zip(data, self.inputs)]
        n_rows = self._check(rt, steps, max_seconds, batch_size, datas)
        for d, v in zip(datas, self.inputs):
            if d.dtype != np.dtype(v.type.dtype) or d.ndim != v.type.ndim:
                raise TypeError(f"data for {v}: dtype {d.dtype}, ndim {d.ndim}; expected {v.type.dtype}, "
                                f"ndim {v.type.ndim}")
        if not self._warm:              # compile in the master, load in the workers (a normal call)
            self.grad_function(*datas, batch=slice(0, min(n_rows, 2 * rt.n)))
            self.update_function._replica.f()                       # compiled; result dropped
            self._warm = True
        from synkhronos import backends
        from synkhronos.plans import Need, Rows
        nbytes = self.size * self.dtype.itemsize
        with rt.api(True):
            ctx = rt.me
            workers = tuple(ctx.control.workers)
            ch = backends.open_channel(ctx.control, workers, nbytes, nbytes)
            try:
                spec = dict(channel=ch.token, workers=workers, nbytes=nbytes, dtype=self.dtype.str,
                            grad_fid=self.grad_function._replica.fid,
                            params=[_vid(rt, p, "ParameterServer") for p in self.params],
                            data=[d._ref() for d in datas], rows=n_rows, batch=int(batch_size),
                            seed=int(seed))
                result = PSResult(version=self.version)
                self.last_result = result
                server = _Server(self, rt, ch, workers, result, steps, max_seconds, slow_after, verbose)
                # worker j reads rows [j * rows // w, (j + 1) * rows // w) of every input (the
                # master none): what a session across hosts ships to each host with the command
                w = len(workers)
                rows = Rows("range", (0,) + tuple((j * n_rows) // w for j in range(w + 1)))
                needs = tuple(Need(d._ref(), rows) for d in datas)
                try:
                    _, replies = rt.execute(CMD_PS, (spec,), server.serve, what="parameter server run",
                                            needs=needs)
                except synk.RankLost as e:
                    e.ps_result = result
                    raise
                except synk.WorkerError as e:       # a worker raised: the run ends at once
                    failed = e
                else:
                    failed = None
                    for r, rep in replies.items():
                        if rep is not None:
                            result.workers[r] = rep
            finally:
                ch.close()
        self.version = result.version
        if sync or failed is not None:      # (after a failure too: no rank keeps other weights)
            synk.broadcast(self.params)
        if failed is not None:
            failed.ps_result = result
            raise failed
        return result


class _Server:
    """The master's side of one run."""

    def __init__(self, ps, rt, ch, workers, result, steps, max_seconds, slow_after, verbose):
        self.ps, self.rt, self.ch, self.workers, self.res = ps, rt, ch, workers, result
        self.steps = None if steps is None else int(steps)
        self.max_seconds = max_seconds
        self.slow_after = slow_after
        self.verbose = verbose
        dev = rt.device
        self.dev = dev
        self.rep = ps.update_function._replica
        g = dev.get(ps.grad_shared)
        if not (isinstance(g, np.ndarray) and g.flags.writeable and g.flags.c_contiguous and g.size == ps.size):
            g = np.zeros(ps.size, ps.dtype)
            dev.set(ps.grad_shared, g)
        self.grad = g
        self.pieces = []
        off = 0
        for p in ps.params:
            size = int(np.prod(np.shape(p.get_value(borrow=True))))
            self.pieces.append((p, off, off + size))
            off += size

    def _say(self, text):
        if self.verbose:
            print(f"synkhronos: parameter server: {text}", file=sys.stderr, flush=True)

    def _weights_to(self, rank):
        down = self.ch.down(rank, self.ps.dtype, self.ps.size)
        for p, a, b in self.pieces:
            down[a:b] = np.asarray(self.dev.to_host(self.dev.get(p))).reshape(-1)

    def serve(self):
        ch, res, ps = self.ch, self.res, self.ps
        live = set(self.workers)
        stats = {r: dict(sent=0, applied=0, dropped=0, max_staleness=0, staleness_sum=0) for r in self.workers}
        last_seen = {r: None for r in self.workers}
        reported_slow = set()
        version = res.version
        for r in self.workers:                     # the first weights
            self._weights_to(r)
            ch.answer(r, (version, 0, 0, 0), consumed=False)
        t0 = time.monotonic()
        next_check = t0
        order = list(self.workers)
        try:
            while live:
                now = time.monotonic()
                if self.steps is not None and res.applied >= self.steps:
                    break
                if self.max_seconds is not None and now - t0 >= self.max_seconds:
                    break
                if ch.control.aborted():
                    break
                if now >= next_check:              # liveness and slowness, 4 times a second
                    next_check = now + 0.25
                    for r in sorted(live):
                        st = ch.status(r)
                        if st in ("dead", "failed"):
                            live.discard(r)
                            how = "is gone" if st == "dead" else "failed"
                            res.dead.append((r, now - t0, st))
                            self._say(f"worker rank {r} {how} after {now - t0:.2f} s; going on with "
                                      f"rank(s) {sorted(live) or 'none'}")
                        elif self.slow_after is not None and r not in reported_slow:
                            since = last_seen[r] if last_seen[r] is not None else t0
                            if now - since > self.slow_after:
                                reported_slow.add(r)
                                what = "is stopped" if st == "stopped" else "sent nothing"
                                res.slow.append((r, now - t0, st))
                                self._say(f"worker rank {r} {what} for {now - since:.1f} s (slow); "
                                          "the others go on")
                    if not live:
                        break
                ready = [r for r in ch.pending() if r in live]
                if not ready:
                    ch.wait_any(0.02)
                    continue
                ready.sort(key=order.index)        # round-robin: served ones go to the back
                for r in ready:
                    order.remove(r)
                    order.append(r)
                    v_used, rows, loss_bits, _ = ch.message(r)
                    staleness = version - v_used
                    s = stats[r]
                    s["sent"] += 1
                    last_seen[r] = time.monotonic()
                    reported_slow.discard(r)
                    apply = staleness <= ps.max_staleness and (self.steps is None or res.applied < self.steps)
                    if apply:
                        np.copyto(self.grad, ch.up(r, ps.dtype, ps.size))
                        new = self.rep.f()
                        for var, val in zip(self.rep.update_vars, new):
                            self.dev.set(var, val)
                        version += 1
                        res.applied += 1
                        res.staleness.append(staleness)
                        s["applied"] += 1
                        s["max_staleness"] = max(s["max_staleness"], staleness)
                        s["staleness_sum"] += staleness
                    else:
                        res.dropped += 1
                        s["dropped"] += 1
                    res.events.append((time.monotonic() - t0, version, r, staleness,
                                       _bits_float(loss_bits), apply))
                    self._weights_to(r)
                    ch.answer(r, (version, 0, 0, 0))
        finally:
            ch.stop()
            res.version = version
            res.seconds = time.monotonic() - t0
            for r, s in stats.items():
                n_app = s["applied"]
                res.per_rank[r] = dict(sent=s["sent"], applied=n_app, dropped=s["dropped"],
                                       max_staleness=s["max_staleness"],
                                       mean_staleness=s["staleness_sum"] / n_app if n_app else 0.0)
        return None


def _bits_float(i):
    from synkhronos.channel import bits_float
    return bits_float(i)


@worker_command(CMD_PS)
def _ps_worker(ctx, spec):
    """A worker's loop of one parameter-server run."""
    from synkhronos import backends
    from synkhronos.channel import FAILED, FINISHED, RUNNING, float_bits
    dtype = np.dtype(spec["dtype"])
    size = spec["nbytes"] // dtype.itemsize
    ch = backends.attach_channel(ctx.control, spec["channel"], ctx.rank)
    try:
        dev = ctx.device
        f = ctx.replicas[spec["grad_fid"]].f
        arrays = [ctx.view(ref) for ref in spec["data"]]
        j = list(spec["workers"]).index(ctx.rank)
        w = len(spec["workers"])
        lo, hi = (j * spec["rows"]) // w, ((j + 1) * spec["rows"]) // w
        batch = spec["batch"]
        rng = np.random.default_rng([spec["seed"], ctx.rank])
        params = [ctx.shareds[v] for v in spec["params"]]
        shapes = [np.shape(dev.to_host(dev.get(p))) for p in params]
        bounds = np.cumsum([0] + [int(np.prod(s)) for s in shapes])
        order, pos = rng.permutation(np.arange(lo, hi)), 0
        sent = 0
        t_compute = 0.0
        ch.set_state(RUNNING)
        while True:
            meta = ch.wait_answer("the parameter server's weights")
            if meta is None:
                break
            version = meta[0]
            down = ch.down(ctx.rank, dtype, size)
            for p, a, b, s in zip(params, bounds[:-1], bounds[1:], shapes):
                dev.set(p, dev.to_device(np.array(down[a:b], copy=True).reshape(s)))
            if pos + batch > len(order):
                order, pos = rng.permutation(np.arange(lo, hi)), 0
            idx = np.sort(order[pos:pos + batch])
            pos += batch
            t = time.perf_counter()
            loss, g = f(*[a[idx] for a in arrays])
            t_compute += time.perf_counter() - t
            np.copyto(ch.up(ctx.rank, dtype, size), np.asarray(dev.to_host(g)).reshape(-1), casting="same_kind")
            ch.send((version, batch, float_bits(float(np.asarray(dev.to_host(loss)))), 0))
            sent += 1
        ch.set_state(FINISHED)
        return dict(sent=sent, compute_seconds=t_compute)
    except BaseException:
        try:
            ch.set_state(FAILED)
        except Exception:
            pass
        raise
    finally:
        ch.close()
