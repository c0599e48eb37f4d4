"""Helpers built on synkhronos: data-parallel update rules and a one-call training step.

    from synkhronos.extensions import updates, train
    step = train.make_train_function(loss, params, [x, y], updates.adam, learning_rate=1e-3)
    synk.distribute()
    loss_value = step(x_data, y_data, batch=idx)
"""
from . import train, updates

__all__ = ["updates", "train"]
