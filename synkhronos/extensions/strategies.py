"""The exchange strategies a training step can use, and who builds each one.

``train.make_train_function(..., exchange=, compress=)`` reads its arguments with
``parse_strategy`` and hands the strategy to the builder registered for its class.  The
builders live in ``synkhronos.extensions.exchange`` (which imports ``train``) and register
themselves when that package is imported, so this module sits below both: ``train`` never
imports the strategies' implementations, and nothing here imports ``train``."""
from dataclasses import dataclass

__all__ = ["Fp16", "EASGD", "LocalSGD", "ShardedUpdates", "parse_strategy", "register", "builder"]


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


@dataclass(frozen=True)
class ShardedUpdates:
    """Synchronous training with the update rule's state and work split over the ranks
    (ZeRO stage 1; ``make_train_function(shard_updates=True)``, built by
    ``synkhronos.extensions.sharded``)."""


def parse_strategy(exchange, compress, error_feedback):
    """``make_train_function``'s ``exchange``/``compress``/``error_feedback`` -> a strategy
    (``Fp16``, ``EASGD`` or ``LocalSGD``), or None for the plain synchronous step."""
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


_BUILDERS = {}          # strategy class -> builder


def register(spec_class, build):
    """Make ``build(strategy, loss, params, inputs, *args, **options)`` (the arguments of
    ``make_train_function`` without the strategy's) the builder of ``spec_class``'s steps."""
    _BUILDERS[spec_class] = build


def builder(strategy):
    """The builder registered for ``strategy``'s class."""
    try:
        return _BUILDERS[type(strategy)]
    except KeyError:
        raise LookupError(f"no training step is registered for {type(strategy).__name__}: import "
                          "synkhronos.extensions.exchange") from None
