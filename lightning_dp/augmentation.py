"""The two helpers of a training step with augmentation multiplicity (De, Berrada, Hayes, Smith and Balle 2022,
"Unlocking high-accuracy differentially private image classification through scale", Section 3.2): the copies of
a batch, and each example's loss from its copies' losses (docs/design.md section 4.8).

With the privacy option ``augmentation_multiplicity = K`` the training step receives the batch of ``B`` sampled
examples as usual, makes ``K`` copies of each, augments every copy on its own, and returns one loss per example, the
mean of its copies' losses::

    x, y = repeat_for_multiplicity(batch, K)              # [B K, ...], rows i K .. i K + K - 1 are example i's
    if self.training:                                      # like dropout: off in eval mode (see below)
        x = augment(x)                                     # per row, e.g. random crop and flip
    rows = F.cross_entropy(self(x), y, reduction="none")   # [B K]
    return augmentation_mean(rows, K)                      # [B]

The gradient of that mean is the average of the copies' gradients, which the clipper clips once per example
(:mod:`lightning_dp.clipping.multiplicity`): one example's sensitivity stays ``C``, whatever ``K``.

Why the copies are made inside the step and not by the data loader: the Poisson sampler, the checks (batch
independence, leave-half-out), FSDP2's stand-in batch and the loss-shape check all read the batch's first dimension as
its examples. Why the augmentation is off in eval mode: the leave-half-out check (docs/design.md section 9.4) runs the
step in eval mode on the whole batch and on half of it and compares the kept examples' losses; copies augmented from
one random stream would differ between the two runs (the half batch draws fewer values) and be reported as mixing.
"""

from __future__ import annotations

from typing import Any, TypeVar

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_dp.clipping.multiplicity import validate_multiplicity

Batch = TypeVar("Batch")


def repeat_for_multiplicity(batch: Batch, multiplicity: int) -> Batch:
    """``multiplicity`` copies of every example of ``batch``, in sample-major order.

    Args:
        batch: a tensor ``[B, ...]`` or any nesting of tuples, lists, dicts (``BatchEncoding`` included) and
            dataclasses holding tensors, their first dimension the examples.
        multiplicity: ``K >= 1``.

    Returns:
        The same structure with every tensor of at least one dimension repeated along its first dimension as
        ``tensor.repeat_interleave(K, 0)`` does: ``[B K, ...]``, rows ``i K .. i K + K - 1`` copies of row ``i``
        (a new tensor, differentiable). Scalars (0-dim tensors) and non-tensors are left as they are; ``K = 1``
        returns ``batch`` itself.

    Raises:
        ValueError: ``multiplicity`` not an integer >= 1.
    """
    validate_multiplicity(multiplicity)
    if multiplicity == 1:
        return batch

    def repeat(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.ndim == 0 else tensor.repeat_interleave(multiplicity, dim=0)

    return apply_to_collection(batch, torch.Tensor, repeat)


def augmentation_mean(loss_rows: torch.Tensor, multiplicity: int) -> torch.Tensor:
    """Each example's loss: the mean of its ``multiplicity`` copies' losses (De et al. 2022, Section 3.2).

    Args:
        loss_rows: ``[B K]``, one loss per row of the forward, in sample-major order (rows ``i K .. i K + K - 1``
            are example ``i``'s, as :func:`repeat_for_multiplicity` makes them).
        multiplicity: ``K >= 1``.

    Returns:
        ``[B]``, ``loss_i = (1/K) sum_k loss_rows[i K + k]`` (differentiable; ``loss_rows`` itself for ``K = 1``).

    Raises:
        ValueError: ``multiplicity`` not an integer >= 1; ``loss_rows`` not one-dimensional or of a length that is
            not a multiple of ``K``.
    """
    validate_multiplicity(multiplicity)
    if not isinstance(loss_rows, torch.Tensor) or loss_rows.ndim != 1 or loss_rows.shape[0] % multiplicity:
        shape: Any = tuple(loss_rows.shape) if isinstance(loss_rows, torch.Tensor) else type(loss_rows).__name__
        raise ValueError(
            f"augmentation_mean needs one loss per row of the forward, shape [B*K] with K={multiplicity}, got {shape}: "
            "reduce token losses per row first (reduction='none', then a mean over each row's tokens)"
        )
    if multiplicity == 1:
        return loss_rows
    return loss_rows.reshape(-1, multiplicity).mean(1)
