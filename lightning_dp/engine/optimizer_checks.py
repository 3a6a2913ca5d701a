"""Before training starts: the optimizers update only parameters of the clipped model (a tensor the clipping hooks
never see would be noised, never clipped)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_dp.engine.run_state import RunState
from lightning_dp.optim import DPOptimizer


def check_optimizers(run: RunState, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Every tensor the (unwrapped) ``optimizers`` update is a parameter of the model ``run``'s clipper is attached to.

    Raises:
        ValueError: an optimizer updates tensors that are not parameters of the clipped model (they would be noised,
            never clipped).
    """
    if run.clipper is None:
        return
    parameters = {id(p) for p in run.clipper.module.parameters()}
    updated = [
        p for opt in optimizers if not isinstance(opt, DPOptimizer) for g in opt.param_groups for p in g["params"]
    ]
    foreign = sum(1 for p in updated if id(p) not in parameters)
    if foreign:
        raise ValueError(
            f"the optimizer updates {foreign} tensor(s) that are not parameters of the model: their gradients "
            "would be noised but never clipped. Register them in the model, and build the optimizer from the "
            "model's parameters after any sharding (with accelerate's FSDP2 configuration DPTrainer shards the "
            "model itself, replacing its parameters: let the Trainer build the optimizer instead of passing "
            "optimizers=(optimizer, scheduler))"
        )
