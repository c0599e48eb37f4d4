"""Local SGD (``LocalSGD``): local steps, the parameters averaged over the ranks every
``k`` steps, chained in that step's command."""
import synkhronos as synk
from synkhronos.session import get_session

from .. import strategies
from .common import register_variables, shared_id
from .local_step import LocalTrainFunction, local_parts


class LocalSGDTrainFunction(LocalTrainFunction):
    """The step of ``LocalSGD``: every ``k``-th step also averages the parameters (and the
    variables of ``also``: ``averaged``) over the ranks, chained in the step's command."""

    def __init__(self, f_local, params, state, inputs, spec):
        super().__init__(f_local, params, state, inputs)
        if int(spec.k) < 1:
            raise ValueError(f"LocalSGD k must be >= 1, got {spec.k}")
        self.k = int(spec.k)
        self.averaged = list(params) + [v for v in spec.also if all(v is not p for p in params)]
        self._reg = register_variables("local_sgd_register", self.averaged) if spec.also else None

    def _then(self, t):
        if t % self.k:
            return ()
        session = get_session(True)
        return tuple(("all_reduce", shared_id(session, v, "LocalSGD"), "avg") for v in self.averaged)

    def average(self):
        """Average the parameters over the ranks now."""
        synk.all_reduce(self.averaged, op="avg")


def build(strategy, *args, **options):
    """``make_train_function`` with ``LocalSGD``."""
    return LocalSGDTrainFunction(*local_parts(*args, **options), strategy)


strategies.register(strategies.LocalSGD, build)
