"""Input canaries (black-box; Steinke, Nasr & Jagielski 2023, Section 7, and Jagielski et al. 2020): ``m``
candidate examples (e.g. mislabelled or out-of-distribution), each added to the training set with probability 1/2;
after training, a canary's score is minus its loss (a trained-on example has a lower loss)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Subset

from lightning_dp.audit.canaries import audit_generator, draw_inclusion


class InputCanaries:
    """Random inclusion of candidate examples into a training set, and their loss scores.

    Args:
        candidates: the m canary examples (a map-style dataset yielding the same batch structure as the data).
        seed: seed of the audit's own generator (``None``: OS entropy).

    Attributes:
        included: ``[m]`` booleans, the canaries added to the training set.
    """

    def __init__(self, candidates: Dataset, *, seed: int | None = None) -> None:
        self.candidates = candidates
        self.included = draw_inclusion(len(candidates), audit_generator(seed))

    def training_set(self, dataset: Dataset) -> ConcatDataset:
        """``dataset`` followed by the included canaries (train on it; the DP sample rate counts them in N)."""
        return ConcatDataset([dataset, Subset(self.candidates, torch.nonzero(self.included).flatten().tolist())])

    @torch.no_grad()
    def scores(self, per_sample_loss: Callable[[object], torch.Tensor], *, batch_size: int = 256) -> np.ndarray:
        """``[m]`` scores ``-loss`` of every candidate under the trained model.

        Args:
            per_sample_loss: maps a batch of candidates to their losses ``[B]`` (e.g. a LightningModule's
                ``training_step(batch, 0)``, which returns per-sample losses under DP training).
            batch_size: candidates per evaluation batch.

        Raises:
            ValueError: ``per_sample_loss`` does not return one loss per candidate.
        """
        losses = []
        for batch in DataLoader(self.candidates, batch_size=batch_size):
            loss = per_sample_loss(batch)
            if loss.ndim != 1:
                raise ValueError(f"per_sample_loss must return a loss per example, shape [B]; got {tuple(loss.shape)}")
            losses.append(loss.detach().double().cpu())
        scores = -torch.cat(losses).numpy()
        if scores.size != len(self.candidates):
            raise ValueError(f"per_sample_loss returned {scores.size} losses for {len(self.candidates)} candidates")
        return scores
