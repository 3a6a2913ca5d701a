"""The training's workload that a correlated-noise strategy is optimised for (docs/correlated_noise.md, "How it
works"): the heavy-ball momentum of its optimizer and the learning rate of each planned step, read before the first
step from the optimizer and its scheduler. The workload changes how much of the noise cancels in the iterates, never
the privacy: ``C`` is fixed before training from the configuration, not from the data.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import types
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from lightning_dp.correlated_noise.workloads import Workload

log = logging.getLogger("lightning_dp")

#: A learning-rate schedule is folded into the workload for at most this many planned steps: its error is a dense
#: ``n x n`` computation (memory and time ``O(n^2)`` per evaluation of the optimiser), against ``O(n log n)`` for a
#: constant rate. Longer runs get the constant-rate workload (logged).
MAX_SCHEDULED_STEPS = 1000


def sgd_momentum(optimizers: Sequence[torch.optim.Optimizer]) -> float:
    """The heavy-ball momentum ``beta`` the strategy is optimised for: that of a single ``torch.optim.SGD`` whose
    groups all use one ``momentum > 0`` without dampening or Nesterov (its iterates are then linear in the noisy
    gradients through the momentum workload, :class:`~lightning_dp.correlated_noise.workloads.Workload`); 0.0 (prefix
    sums) for anything else."""
    inner = [getattr(optimizer, "original_optimizer", optimizer) for optimizer in optimizers]
    if len(inner) != 1 or type(inner[0]) is not torch.optim.SGD:
        return 0.0
    groups = inner[0].param_groups
    momenta = {float(group.get("momentum", 0.0)) for group in groups}
    plain = all(not group.get("nesterov", False) and not group.get("dampening", 0.0) for group in groups)
    if len(momenta) != 1 or not plain:
        return 0.0
    (beta,) = momenta
    return beta if 0.0 < beta < 1.0 else 0.0


def stand_in_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A ``torch.optim.SGD`` over one scalar per parameter group of ``optimizer``, each group with a copy of its
    options (``lr``, ``initial_lr``, momenta): what a scheduler reads and writes, without the model's tensors."""
    groups = [{**copy.deepcopy({k: v for k, v in g.items() if k != "params"}), "params": [torch.zeros(1)]} for g in
              getattr(optimizer, "original_optimizer", optimizer).param_groups]  # fmt: skip
    return torch.optim.SGD(groups)


def scheduled_learning_rates(scheduler: Any, steps: int, *, steps_per_call: int = 1) -> tuple[float, ...] | None:
    """The learning rate of each of ``steps`` optimizer steps under ``scheduler``, called once every
    ``steps_per_call`` steps (after the step, as the trainers call it), read from a copy of the scheduler bound to a
    stand-in optimizer (:func:`stand_in_optimizer`): the scheduler and its optimizer are left as they are.

    Args:
        scheduler: one of torch's ``torch.optim.lr_scheduler`` schedulers (``SequentialLR`` and ``ChainedScheduler``
            of them included; ``LambdaLR``'s and ``MultiplicativeLR``'s lambdas plain functions of the step or
            ``functools.partial`` of one, as HF's schedules are), in the state it starts training in.
        steps: the planned optimizer steps.
        steps_per_call: optimizer steps between two calls of ``scheduler.step()`` (1: every step).

    Returns:
        ``steps`` learning rates (those of the first parameter group; the other groups' must be proportional to them),
        or ``None`` when the schedule is not read (logged): ``ReduceLROnPlateau`` (its rates follow a metric), another
        scheduler class or a lambda that is a bound method or a callable object (a copy could hold the model), a
        scheduler that raises while it is copied or stepped, groups on schedules that are not proportional, or
        non-finite or negative rates.
    """
    if not _readable(scheduler):
        log.info(
            "the learning-rate schedule of %s is not read (torch's schedulers over functions of the step are): C is "
            "optimised for a constant rate",
            type(scheduler).__name__,
        )
        return None
    try:
        rates = _simulate(scheduler, steps, steps_per_call)
    except Exception as error:  # a user's lambda: anything it raises means its schedule is not known here
        log.info("the learning-rate schedule could not be read (%s): C is optimised for a constant rate", error)
        return None
    first = [row[0] for row in rates]
    if not all(math.isfinite(rate) and rate >= 0.0 for rate in first) or max(first) <= 0.0:
        return None
    peak = rates[first.index(max(first))]
    ratios = [rate / peak[0] for rate in peak]
    proportional = all(
        math.isclose(rate, ratio * base, rel_tol=1e-9, abs_tol=1e-12)
        for row, base in zip(rates, first, strict=True)
        for rate, ratio in zip(row, ratios, strict=True)
    )
    return tuple(first) if proportional else None


def _readable(scheduler: Any) -> bool:
    """Whether ``scheduler`` is one of torch's own (not ``ReduceLROnPlateau``), its children too, with lambdas that are
    plain functions or partials of one over plain values: a deep copy then holds no model and no tensor."""
    module = torch.optim.lr_scheduler
    if type(scheduler).__module__ != module.__name__ or isinstance(scheduler, module.ReduceLROnPlateau):
        return False
    children = getattr(scheduler, "_schedulers", None)
    if children is not None:
        return all(_readable(child) for child in children)
    return all(_plain_function(function) for function in getattr(scheduler, "lr_lambdas", ()))


def _plain_function(function: Any) -> bool:
    if isinstance(function, functools.partial):
        arguments = (*function.args, *function.keywords.values())
        return _plain_function(function.func) and all(isinstance(a, int | float | str | bool) for a in arguments)
    return isinstance(function, types.FunctionType)


def _simulate(scheduler: Any, steps: int, steps_per_call: int) -> list[list[float]]:
    """Every group's learning rate at each step, from a deep copy of ``scheduler`` whose optimizer (and every
    reference to it, through ``deepcopy``'s memo) is a stand-in."""
    optimizer = scheduler.optimizer
    stand_in = stand_in_optimizer(optimizer)
    clone = copy.deepcopy(scheduler, memo={id(optimizer): stand_in})
    rates = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()": nothing trains here
        for step in range(steps):
            rates.append([float(group["lr"]) for group in stand_in.param_groups])
            if (step + 1) % steps_per_call == 0:
                clone.step()
    return rates


def training_workload(
    optimizers: Sequence[torch.optim.Optimizer], learning_rates: Sequence[float] | None, steps: int | None
) -> Workload | None:
    """The workload of the run: :func:`sgd_momentum` of ``optimizers`` and the ``learning_rates`` of its ``steps``
    planned steps (:func:`scheduled_learning_rates`; ``None``, or one rate throughout: constant). ``None`` for prefix
    sums (plain SGD at a constant rate, or no planned steps: ``None`` or 0); a schedule over more than
    :data:`MAX_SCHEDULED_STEPS` steps is left out (logged).

    Raises:
        ValueError: ``learning_rates`` of another length than ``steps``.
    """
    if not steps:
        return None
    momentum = sgd_momentum(optimizers)
    if learning_rates is not None and len(learning_rates) != steps:
        raise ValueError(f"{len(learning_rates)} learning rates for {steps} planned steps")
    if learning_rates is not None and len(set(learning_rates)) > 1:
        if steps <= MAX_SCHEDULED_STEPS:
            return Workload(steps, momentum, tuple(learning_rates))
        log.info(
            "the learning-rate schedule of the %d planned steps is not folded into the correlated noise's workload "
            "(at most %d steps): C is optimised for a constant rate",
            steps,
            MAX_SCHEDULED_STEPS,
        )
    return Workload(steps, momentum) if momentum else None
