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
  On every rank: the variable's wire scale ``s`` (a power of two, 1 unless the values are
  large, the same on every rank: one small all-reduce of each rank's largest magnitude, so
  that the float16 sum of every rank's values cannot overflow), ``shadow = float16((value
  [+ residual]) * s)`` (numba kernel, ``synkhronos.kernels.half``), the comm plane's
  all-reduce of the float16 shadows (summed in float32, rounded once to float16),
  ``value = float32(result) / s``: no finite value becomes inf.  With error feedback each
  rank keeps ``residual = (value + residual) - float32(shadow) / s``: what the rounding lost is sent with
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
  exchange through a channel (``synkhronos.channel``: shared memory inside a host; across
  hosts each host's agent relays its workers' messages over MPI).

Also here: ``straggle(x, {rank: seconds})``, an identity op that sleeps on the given ranks
(to simulate a slow worker).

Layout: ``fp16`` (the compressed all-reduce; each rank's side in ``fp16_rank``),
``fp16_step``, ``easgd`` and ``local_sgd`` (the training steps; the last two share
``local_step``), ``parameter_server`` (master's loop ``ps_server``, worker's ``ps_worker``),
``straggler``, and ``common`` (what they share).  The strategy specs (``Fp16``, ``EASGD``,
``LocalSGD``) are ``synkhronos.extensions.strategies``, below ``train``: each step module
registers its builder there when imported, so ``train.make_train_function`` builds every
strategy without importing this package (``exchange.make_train_function`` is that same
function)."""
from ..strategies import EASGD, Fp16, LocalSGD
from ..train import make_train_function
from .easgd import EASGDTrainFunction
from .fp16 import Fp16AllReduce, all_reduce, prepare
from .fp16_step import CompressedTrainFunction
from .local_sgd import LocalSGDTrainFunction
from .local_step import LocalTrainFunction
from .parameter_server import ParameterServer, PSResult
from .straggler import Straggle, straggle

__all__ = ["all_reduce", "prepare", "Fp16AllReduce", "Fp16", "EASGD", "LocalSGD", "make_train_function",
           "CompressedTrainFunction", "LocalTrainFunction", "EASGDTrainFunction", "LocalSGDTrainFunction",
           "ParameterServer", "PSResult", "straggle", "Straggle"]
