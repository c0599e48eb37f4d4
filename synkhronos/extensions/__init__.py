"""Helpers built on synkhronos: data-parallel update rules, a one-call training step and
the exchange strategies it can use.

    from synkhronos.extensions import updates, train
    step = train.make_train_function(loss, params, [x, y], updates.adam, learning_rate=1e-3)
    synk.distribute()
    loss_value = step(x_data, y_data, batch=idx)

``exchange`` and ``sharded`` are imported here so that their builders are registered
whichever of these modules is imported first.
"""
from . import exchange, sharded, train, updates

__all__ = ["updates", "train", "exchange", "sharded"]
