"""Lightning callbacks of the audit: ``GradientCanaryAudit`` audits a :class:`~lightning_dp.DPStrategy` run in one
run; ``ScaleNoiseForTesting`` is the TEST-ONLY control that breaks a run's noise (:mod:`lightning_dp.audit.controls`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_dp.audit.controls import NoiseScaledForTesting
from lightning_dp.audit.gradient import GradientCanaries
from lightning_dp.audit.report import AuditReport, report_for
from lightning_dp.lightning.dp_mixin import DPStrategyMixin
from lightning_dp.optim import DPOptimizer

log = logging.getLogger("lightning_dp")


class GradientCanaryAudit(Callback):
    """Inject ``m`` Dirac gradient canaries into a DP training run and bound its epsilon from below.

    ``trainer = Trainer(strategy=DPStrategy(...), callbacks=[audit := GradientCanaryAudit(1000)])``, then after
    ``trainer.fit(...)``, ``audit.report()`` gives the audited lower bound next to the reported epsilon (Steinke,
    Nasr & Jagielski 2023, Algorithm 1 with the bound of their theorem for approximate DP; canaries as in
    :mod:`lightning_dp.audit.gradient`). One process only (``DPStrategy``).

    Args:
        num_canaries: m, at most the number of trainable coordinates.
        seed: seed of the audit's own generator (``None``: OS entropy).
        coordinates: candidate canary coordinates (see :class:`~lightning_dp.audit.gradient.GradientCanaries`).

    Raises:
        TypeError: the trainer's strategy is not a DP strategy.
        ValueError: several processes, or not exactly one DP optimizer (at the first training batch).
    """

    def __init__(self, num_canaries: int, *, seed: int | None = None, coordinates: torch.Tensor | None = None) -> None:
        self.canaries = GradientCanaries(num_canaries, seed=seed, coordinates=coordinates)
        self._strategy: DPStrategyMixin | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        """Install the canaries on the DP optimizer once it exists (the strategy wraps it at train start)."""
        if self._strategy is not None:
            return
        strategy, optimizer = dp_optimizer_of(trainer, type(self).__name__)
        self.canaries.install(optimizer, sample_rate=strategy.privacy_engine.sample_rate)
        self._strategy = strategy

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.canaries.remove()

    def report(self, *, confidence: float = 0.95, guess_sets: Sequence[tuple[int, int]] | None = None) -> AuditReport:
        """The audited lower bound (at ``confidence``, delta = the run's ``target_delta``) and the reported epsilon.

        Raises:
            RuntimeError: no training step was observed.
        """
        if self._strategy is None or self.canaries.steps_observed == 0:
            raise RuntimeError("No DP training step was observed: call trainer.fit(...) with this callback first")
        return report_for(
            self._strategy.privacy_engine,
            self.canaries.scores,
            self.canaries.included.numpy(),
            "gradient",
            confidence,
            guess_sets,
        )


class ScaleNoiseForTesting(Callback):
    """TEST-ONLY control: from the first training batch on, every noise draw of the run is multiplied by ``factor``
    while the accountant keeps the original noise (:class:`~lightning_dp.audit.controls.NoiseScaledForTesting`),
    so the reported epsilon is FALSE and an audit should say so. Never use it to train a model.

    Args:
        factor: in (0, 1), e.g. 0.1 for a tenth of the noise the accountant assumes.

    Raises:
        ValueError: ``factor`` outside (0, 1); see :func:`dp_optimizer_of` for the trainer checks.
    """

    def __init__(self, factor: float) -> None:
        if not 0.0 < factor < 1.0:
            raise ValueError(f"factor must lie in (0, 1) to under-noise the run, got {factor}")
        self.factor = float(factor)
        self._installed = False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self._installed:
            return
        strategy, optimizer = dp_optimizer_of(trainer, type(self).__name__)
        log.warning(
            "TEST-ONLY: the noise is scaled by %g while the accountant assumes the full noise; the reported epsilon "
            "of this run is FALSE",
            self.factor,
        )
        optimizer.mechanism = NoiseScaledForTesting(optimizer.mechanism, self.factor)
        strategy.privacy_engine.broken_for_testing = f"noise scaled by {self.factor:g}: the reported epsilon is false"
        self._installed = True


def dp_optimizer_of(trainer: pl.Trainer, user: str) -> tuple[DPStrategyMixin, DPOptimizer]:
    """The trainer's DP strategy and its single DP optimizer (wrapped at train start).

    Raises:
        TypeError: the strategy is not a DP strategy.
        ValueError: several processes, or not exactly one DP optimizer.
    """
    strategy = trainer.strategy
    if not isinstance(strategy, DPStrategyMixin):
        raise TypeError(f"{user} works on DPStrategy runs, the trainer uses {type(strategy).__name__}")
    if trainer.world_size > 1:
        raise ValueError(f"{user} runs on one process: use DPStrategy, not DPDDPStrategy")
    optimizers = [opt for opt in strategy.optimizers if isinstance(opt, DPOptimizer)]
    if len(optimizers) != 1:
        raise ValueError(f"{user} needs exactly one DP optimizer, found {len(optimizers)}")
    return strategy, optimizers[0]
