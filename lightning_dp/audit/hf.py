"""``HFGradientCanaryAudit``: the one-run gradient-canary audit of a :class:`~lightning_dp.hf.DPTrainer` run (the
HF path; the Lightning path is :class:`~lightning_dp.audit.GradientCanaryAudit`). Same canaries, injection and
scores (:mod:`lightning_dp.audit.gradient`), installed through the documented ``TrainerCallback`` hooks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import TrainerCallback

from lightning_dp.audit.gradient import GradientCanaries
from lightning_dp.audit.report import AuditReport, report_for
from lightning_dp.hf import DPTrainer
from lightning_dp.optim import DPOptimizer


class HFGradientCanaryAudit(TrainerCallback):
    """``trainer.add_callback(audit := HFGradientCanaryAudit(trainer, 1000))``, ``trainer.train()``, then
    ``audit.report()``. One process only.

    Args:
        trainer: the DP trainer to audit (its privacy engine gives the sample rate, delta and reported epsilon).
        num_canaries: m; seed, coordinates: as :class:`~lightning_dp.audit.gradient.GradientCanaries`.

    Raises:
        ValueError: several processes, or no DP optimizer at the first step.
    """

    def __init__(
        self,
        trainer: DPTrainer,
        num_canaries: int,
        *,
        seed: int | None = None,
        coordinates: torch.Tensor | None = None,
    ) -> None:
        self.trainer = trainer
        self.canaries = GradientCanaries(num_canaries, seed=seed, coordinates=coordinates)
        self._installed = False

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Install the canaries on the DP optimizer (created by ``train()`` before the first step)."""
        if self._installed:
            return
        if args.world_size > 1:
            raise ValueError("HFGradientCanaryAudit runs on one process")
        optimizer = self.trainer.optimizer
        optimizer = optimizer if isinstance(optimizer, DPOptimizer) else getattr(optimizer, "optimizer", None)
        if not isinstance(optimizer, DPOptimizer):
            raise ValueError("HFGradientCanaryAudit found no DP optimizer: audit a DPTrainer")
        self.canaries.install(optimizer, sample_rate=self.trainer.privacy_engine.sample_rate)
        self._installed = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.canaries.remove()

    def report(self, *, confidence: float = 0.95, guess_sets: Sequence[tuple[int, int]] | None = None) -> AuditReport:
        """The audited lower bound at ``confidence`` next to the trainer's reported epsilon.

        Raises:
            RuntimeError: no training step was observed.
        """
        if self.canaries.steps_observed == 0:
            raise RuntimeError("No DP training step was observed: call trainer.train() with this callback first")
        scores, included = self.canaries.scores, self.canaries.included.numpy()
        return report_for(self.trainer.privacy_engine, scores, included, "gradient", confidence, guess_sets)
