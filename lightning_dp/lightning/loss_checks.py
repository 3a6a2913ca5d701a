"""The check that a Lightning ``training_step`` returned one loss per sampled example (its shape ``[B]`` is checked by
the strategy): each example must have exactly one clipped contribution to the step's sum."""

from __future__ import annotations

import torch

from lightning_dp.config import PrivacyConfig


def check_one_loss_per_example(size: int | None, loss: torch.Tensor, config: PrivacyConfig) -> None:
    """The loss ``[B']`` must have one entry per example of the batch of ``size`` rows (``None``: unknown, and the
    clipper still checks the layers' rows): e.g. ``[2B]`` from concatenating augmented copies would give each example
    two clipped contributions (sensitivity 2C). With ``augmentation_multiplicity = K`` the batch still holds the ``B``
    sampled examples (the step makes their copies, the model sees ``B K`` rows) and the loss is ``[B]``.

    Raises:
        ValueError: another length, saying what to change (with ``K > 1``: a loss per copy, ``[B K]``, or a batch
            whose copies the data loader made, ``B K`` rows).
    """
    if size is None or size == loss.shape[0]:
        return
    if config.privacy_unit == "user":
        raise ValueError(
            f"training_step returned {loss.shape[0]} losses for a batch of {size} rows: with privacy_unit='user' "
            "return one loss per row of the batch (the sampled users' examples); the strategy averages each "
            "user's rows into the user's loss"
        )
    copies = config.augmentation_multiplicity
    if copies > 1 and loss.shape[0] == size * copies:
        raise ValueError(
            f"training_step returned {loss.shape[0]} per-sample losses for a batch of {size} examples, one per "
            f"augmented copy (augmentation_multiplicity={copies}): return one loss per example, the mean over its "
            f"copies, lightning_dp.augmentation_mean(loss, {copies})"
        )
    if copies > 1 and size == loss.shape[0] * copies:
        raise ValueError(
            f"the training batch has {size} rows for {loss.shape[0]} per-sample losses: with "
            f"augmentation_multiplicity={copies} the batch must hold the sampled examples once each (Poisson "
            "sampling and the checks count its rows as examples). Either the data loader or collate_fn made the "
            "copies: make them inside training_step instead; or training_step called "
            f"lightning_dp.augmentation_mean without making the copies first: call "
            f"lightning_dp.repeat_for_multiplicity(batch, {copies}) before the forward"
        )
    raise ValueError(
        f"training_step returned {loss.shape[0]} per-sample losses for a batch of {size} examples: return "
        "exactly one loss per example (average the losses of an example's augmented copies, "
        "lightning_dp.augmentation_mean, with the privacy option augmentation_multiplicity)"
    )
