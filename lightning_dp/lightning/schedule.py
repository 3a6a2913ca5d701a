"""A Lightning run's planned steps before the first: whole logical steps (:func:`check_logical_steps`), and their
learning rates, read from its scheduler (the workload of correlated noise, :mod:`lightning_dp.engine.workload`)."""

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


def check_logical_steps(trainer: pl.Trainer) -> None:
    """Every optimizer step of the run takes a whole Poisson batch: with ``accumulate_grad_batches`` of ``k``, an
    epoch's number of training batches is a multiple of ``k``, and a resume starts at an optimizer step.

    Raises:
        ValueError: an epoch length that is not a multiple of ``k`` (``limit_train_batches``); a resume in the middle
            of a logical step.
    """
    micro = trainer.accumulate_grad_batches
    if micro == 1:
        return
    batches = trainer.num_training_batches
    if math.isfinite(batches) and batches % micro:
        raise ValueError(
            f"{batches} training batches per epoch is not a multiple of accumulate_grad_batches={micro}: an "
            "optimizer step would use part of a Poisson batch. Remove limit_train_batches or make it a multiple"
        )
    done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    if done % micro:
        raise ValueError(
            f"Resuming after {done} micro-batches, in the middle of a logical step of {micro}: resume from a "
            "checkpoint saved at an optimizer step (ModelCheckpoint(every_n_train_steps=...) or epoch end)"
        )
