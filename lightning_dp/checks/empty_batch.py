"""The user's training step on an empty batch, once at the first step (docs/design.md section 9.1): Poisson sampling
draws empty batches at some steps, and a step that fails on zero rows (``x.view(x.size(0), -1)``) would otherwise fail
only at those draws, an error whose step says that its batch was empty.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_dp.checks.attach_probe import restored
from lightning_dp.data.poisson import empty_like_batch

#: What the error of a step that fails on an empty batch asks for.
EMPTY_BATCH_HINT = (
    "Poisson sampling draws empty batches at some steps, so the training step must accept a batch of zero rows "
    "(e.g. x.flatten(1) rather than x.view(x.size(0), -1))"
)


def check_empty_batch(step: Callable[[Any], torch.Tensor | None], batch: Any, module: nn.Module) -> None:
    """Run ``step`` (``batch -> [B]`` per-sample loss, or ``None``) on ``batch`` cut to zero rows as an empty Poisson
    batch is (:func:`~lightning_dp.data.poisson.empty_like_batch`), in train mode under ``no_grad``, with the modules'
    modes, their buffers and the global RNGs (torch, numpy, ``random``) restored afterwards.

    Raises:
        ValueError: the step raised on the empty batch (chained), or returned a loss other than ``[0]``.
    """
    with restored(module), torch.no_grad():
        try:
            loss = step(empty_like_batch(batch))
        except Exception as error:
            raise ValueError(
                f"training_step failed on an empty batch ({type(error).__name__}: {error}): {EMPTY_BATCH_HINT}"
            ) from error
    if loss is not None and tuple(loss.shape) != (0,):
        shape = tuple(loss.shape)
        raise ValueError(f"training_step returned a loss of shape {shape} on an empty batch: {EMPTY_BATCH_HINT}")
