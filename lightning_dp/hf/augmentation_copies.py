"""Augmentation multiplicity under :class:`~lightning_dp.hf.DPTrainer` (``augmentation_multiplicity = K > 1``, De et
al. 2022, Section 3.2; docs/design.md section 4.8).

DPTrainer repeats every tensor of the collated batch ``K`` times in sample-major order
(:func:`lightning_dp.repeat_for_multiplicity`), hands the copies to the user's ``DPTrainer.augment_copies`` in train
mode, checks that the rows stayed in place (:func:`check_rows_in_place`), and takes each example's mean loss over
its copies (:func:`lightning_dp.augmentation_mean`), so each example's averaged gradient is clipped once. The
methods stay on ``DPTrainer`` (users override ``augment_copies``); this module holds what they call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from lightning_dp.augmentation import augmentation_mean, repeat_for_multiplicity


def check_augmentation(copies: int, augment_copies_overridden: bool) -> None:
    """Reject ``augmentation_multiplicity > 1`` when ``DPTrainer.augment_copies`` is not overridden: ``K`` identical
    copies average to the gradient of one, at ``K`` times the cost.

    Args:
        copies: ``augmentation_multiplicity``.
        augment_copies_overridden: whether a subclass overrides ``DPTrainer.augment_copies``.

    Raises:
        ValueError: ``copies > 1`` without an ``augment_copies`` of a subclass.
    """
    if copies > 1 and not augment_copies_overridden:
        raise ValueError(
            f"augmentation_multiplicity={copies}: DPTrainer makes {copies} copies of each example, and the copies "
            "must be augmented, by your code: subclass DPTrainer and override augment_copies(inputs) (it receives "
            "the collated batch with every tensor repeated, rows i*K .. i*K+K-1 example i's, and returns it "
            "augmented row by row); or set augmentation_multiplicity=1"
        )


def mean_loss_over_copies(
    model: nn.Module,
    inputs: dict[str, Any],
    copies: int,
    per_example_loss: Callable[[nn.Module, dict[str, Any]], torch.Tensor],
    augment_copies: Callable[[dict[str, Any]], dict[str, Any]],
) -> torch.Tensor:
    """``[B]``: each example's mean over the losses of its ``copies`` copies, augmented by ``augment_copies`` (and
    checked by :func:`check_rows_in_place`) when the model is in train mode.

    Args:
        model: the (training) model.
        inputs: the batch on the device, ``{name: [B, ...]}``.
        copies: ``K``, the augmentation multiplicity.
        per_example_loss: ``DPTrainer.compute_per_example_loss``.
        augment_copies: ``DPTrainer.augment_copies``.
    """
    rows = repeat_for_multiplicity(inputs, copies)
    if model.training:
        augmented = augment_copies(rows)
        check_rows_in_place(inputs, rows, augmented, copies)
        rows = augmented
    return augmentation_mean(per_example_loss(model, rows), copies)


def check_rows_in_place(original: dict[str, Any], repeated: dict[str, Any], augmented: Any, copies: int) -> None:
    """Refuse copies that ``DPTrainer.augment_copies`` moved across examples (docs/design.md section 4.8).

    ``labels`` (when ``original`` has them) must come back equal to the repeated labels row for row; every other
    integer or boolean tensor present before and after with the same shape must not hold, in a row of example ``i``,
    another example's original row that differs from example ``i``'s own (a moved row). Float inputs are left to the
    batch-independence check, which sees their gradients.
    """
    if not isinstance(augmented, Mapping):
        raise ValueError(f"augment_copies must return the inputs' mapping of tensors, got {type(augmented).__name__}")
    hint = (
        f"augment_copies must keep each row in place: rows i*{copies} .. i*{copies}+{copies - 1} are example i's "
        "copies, each augmented from that row alone (a loop over copy k of every example, torch.cat([aug(x[k::K]) "
        "for k in range(K)]), puts one example's copies in several examples' groups: sensitivity up to K*C); use "
        "lightning_dp.augment_each_example(rows, K, fn) to augment each example's copies on their own"
    )
    for key, before in repeated.items():
        after = augmented.get(key)
        if not isinstance(before, torch.Tensor) or not isinstance(after, torch.Tensor) or before.ndim == 0:
            continue
        if key == "labels":
            if after.shape != before.shape or not torch.equal(after.to(before.device), before):
                raise ValueError(f"{hint}; 'labels' came back changed or reordered: return them unchanged")
            continue
        if before.dtype.is_floating_point or before.is_complex() or after.shape != before.shape:
            continue
        after = after.to(before.device)
        mine = original[key]
        flat_after = after.reshape(after.shape[0], -1)
        flat_mine = mine.reshape(mine.shape[0], -1).to(before.device)
        changed = torch.nonzero((flat_after != before.reshape(before.shape[0], -1)).any(1)).flatten()
        if changed.numel() == 0 or flat_mine.shape[0] < 2:
            continue
        # [changed, B]: which original examples each changed row equals exactly
        same = (flat_after[changed].unsqueeze(1) == flat_mine.unsqueeze(0)).all(-1)
        owner = changed // copies
        moved = same.any(1) & ~same[torch.arange(changed.numel(), device=same.device), owner]
        if bool(moved.any()):
            row = int(changed[moved][0])
            raise ValueError(
                f"{hint}; row {row} of '{key}' (a copy of example {row // copies}) holds example "
                f"{int(torch.nonzero(same[moved][0])[0])}'s row"
            )
