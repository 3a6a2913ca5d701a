"""The learning rates of a Lightning run's planned steps, read from its scheduler before the first step (the workload of
correlated noise, :mod:`lightning_dp.engine.workload`)."""

from __future__ import annotations

import math

import lightning.pytorch as pl

from lightning_dp.engine.workload import scheduled_learning_rates


def planned_learning_rates(trainer: pl.Trainer, steps: int) -> tuple[float, ...] | None:
    """The learning rate of each of the ``steps`` planned optimizer steps under the run's one scheduler
    (``configure_optimizers``' ``lr_scheduler``, its ``interval`` and ``frequency`` as Lightning applies them:
    after every ``frequency`` optimizer steps, or at the end of every ``frequency`` epochs), or ``None``: no scheduler,
    several, ``ReduceLROnPlateau``, an epoch interval without a finite epoch length, or a schedule
    :func:`~lightning_dp.engine.workload.scheduled_learning_rates` cannot read.
    """
    configs = trainer.lr_scheduler_configs
    if len(configs) != 1 or configs[0].reduce_on_plateau:
        return None
    config = configs[0]
    per_epoch = trainer.num_training_batches
    if config.interval == "step":
        steps_per_call = config.frequency
    elif math.isfinite(per_epoch) and per_epoch >= trainer.accumulate_grad_batches:
        steps_per_call = config.frequency * (int(per_epoch) // trainer.accumulate_grad_batches)
    else:
        return None
    return scheduled_learning_rates(config.scheduler, steps, steps_per_call=steps_per_call)
