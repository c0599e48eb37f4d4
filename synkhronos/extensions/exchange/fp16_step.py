"""The synchronous training step with its gradient all-reduced in float16 (``Fp16``):
``train``'s step with an ``Fp16AllReduce`` in place of the float32 all-reduce."""
from synkhronos.function import replica_of
from synkhronos.session import get_session

from .. import strategies, train
from .common import as_list, before_distribute
from .fp16 import Fp16AllReduce


class CompressedTrainFunction(train.TrainFunction):
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
        if get_session().distributed:      # (before, the residuals are zeros anyway)
            self.compressor.reset_residuals()

    def _chain(self):
        if not get_session().distributed:
            return ()
        return self.compressor.steps("avg") + (("run", replica_of(self.update_function).fid),)

    def _exchange(self):
        self.compressor("avg")


def build(strategy, loss, params, inputs, *args, name="train", **options):
    """``make_train_function`` with ``Fp16``: the plain step, its gradient compressed."""
    before_distribute("an exchange strategy")
    base = train.make_train_function(loss, params, inputs, *args, name=name, **options)
    grads = as_list(base.grad_shared)
    return CompressedTrainFunction(base, Fp16AllReduce(grads, strategy.error_feedback, name=f"{name}_fp16"))


strategies.register(strategies.Fp16, build)
