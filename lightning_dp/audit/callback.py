"""Lightning callbacks of the audit: ``GradientCanaryAudit`` (Dirac canaries added after clipping) and
``ClippedGradientCanaryAudit`` (canary examples clipped by the run's clipper) audit a :class:`~lightning_dp.DPStrategy`
run in one run; ``ScaleNoiseForTesting`` and ``ScaleClippingForTesting`` are the TEST-ONLY controls that break a run's
noise or its clipping (:mod:`lightning_dp.audit.controls`).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_dp.audit.clipped import ClippedGradientCanaries
from lightning_dp.audit.controls import NoiseScaledForTesting, scale_clipping_for_testing
from lightning_dp.audit.gradient import GradientCanaries
from lightning_dp.audit.report import AuditReport, report_for
from lightning_dp.lightning.dp_mixin import DPStrategyMixin
from lightning_dp.optim import DPOptimizer

log = logging.getLogger("lightning_dp")


class _CanaryAudit(Callback, ABC):
    """What both canary audits share: canaries installed at the first training batch (the strategy wraps the
    optimizer at train start), removed at the end, and the report. A subclass sets ``mode`` and installs its
    canaries in :meth:`_install`."""

    mode: str
    canaries: GradientCanaries | ClippedGradientCanaries

    def __init__(self) -> None:
        self._strategy: DPStrategyMixin | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        """Install the canaries on the DP optimizer once it exists (the strategy wraps it at train start)."""
        if self._strategy is not None:
            return
        strategy, optimizer = dp_optimizer_of(trainer, type(self).__name__)
        self._install(strategy, optimizer, pl_module)
        self._strategy = strategy

    @abstractmethod
    def _install(self, strategy: DPStrategyMixin, optimizer: DPOptimizer, pl_module: pl.LightningModule) -> None:
        """Install this audit's canaries on the run's DP optimizer (and, for canary examples, its model)."""

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
            self.mode,
            confidence,
            guess_sets,
        )


class GradientCanaryAudit(_CanaryAudit):
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

    mode = "gradient"

    def __init__(self, num_canaries: int, *, seed: int | None = None, coordinates: torch.Tensor | None = None) -> None:
        super().__init__()
        self.canaries = GradientCanaries(num_canaries, seed=seed, coordinates=coordinates)

    def _install(self, strategy: DPStrategyMixin, optimizer: DPOptimizer, pl_module: pl.LightningModule) -> None:
        self.canaries.install(optimizer, sample_rate=strategy.privacy_engine.sample_rate)


class ClippedGradientCanaryAudit(_CanaryAudit):
    """Score canary EXAMPLES that the run's clipper clips (:mod:`lightning_dp.audit.clipped`) and bound epsilon from
    below.

    Steinke, Nasr & Jagielski 2023, Algorithm 1; unlike :class:`GradientCanaryAudit` it also catches a clipping bug. The
    run must train on ``canaries.training_set(data)`` and give a canary row the loss ``logit_k`` of the audited layer
    (:func:`~lightning_dp.audit.clipped.per_sample_loss_with_canaries`, as
    :class:`~lightning_dp.audit.setups.LinearClassifier` does). One process only (``DPStrategy``).

    Args:
        canaries: the canaries (their inclusion is fixed; pass the same object's ``training_set`` to the trainer).
        layer: path of the audited ``nn.Linear`` in the LightningModule (``module.get_submodule(layer)``).

    Raises:
        TypeError: the trainer's strategy is not a DP strategy.
        ValueError: at the first training batch: several processes, not exactly one DP optimizer,
            ``augmentation_multiplicity > 1``, or a layer that does not fit the canaries or whose canaries clipping
            would not act on.
    """

    mode = "clipped-gradient"

    def __init__(self, canaries: ClippedGradientCanaries, *, layer: str = "layer") -> None:
        super().__init__()
        self.canaries = canaries
        self.layer = layer

    def _install(self, strategy: DPStrategyMixin, optimizer: DPOptimizer, pl_module: pl.LightningModule) -> None:
        copies = strategy.privacy_engine.config.augmentation_multiplicity
        if copies > 1:
            raise ValueError(
                f"{type(self).__name__} builds each canary's gradient from its one row, which augmented copies "
                f"(augmentation_multiplicity={copies}) would change: audit the run with augmentation_multiplicity=1, "
                "or use GradientCanaryAudit (canaries added after clipping)"
            )
        layer = pl_module.get_submodule(self.layer)
        self.canaries.install(optimizer, layer, max_grad_norm=strategy.privacy_engine.max_grad_norm)


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


class ScaleClippingForTesting(Callback):
    """TEST-ONLY control: from the first training batch on, the run's clipper clips per-sample gradients to
    ``factor * C`` while the noise and the accountant keep assuming C
    (:func:`~lightning_dp.audit.controls.scale_clipping_for_testing`), so the reported epsilon is FALSE. Never use it
    to train a model.

    Args:
        factor: > 1, e.g. 10 for a clipper that clips to 10 C.

    Raises:
        ValueError: ``factor <= 1``; see :func:`dp_optimizer_of` for the trainer checks.
    """

    def __init__(self, factor: float) -> None:
        if not factor > 1.0:
            raise ValueError(f"factor must exceed 1 to clip too loosely, got {factor}")
        self.factor = float(factor)
        self._installed = False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self._installed:
            return
        strategy, _ = dp_optimizer_of(trainer, type(self).__name__)
        engine = strategy.privacy_engine
        if engine.clipper is None:
            raise RuntimeError("ScaleClippingForTesting found no per-sample clipper on the DP strategy")
        log.warning(
            "TEST-ONLY: per-sample gradients are clipped to %g x max_grad_norm while the noise and the accountant "
            "assume max_grad_norm; the reported epsilon of this run is FALSE",
            self.factor,
        )
        scale_clipping_for_testing(engine.clipper, self.factor)
        engine.broken_for_testing = f"clipping to {self.factor:g} x max_grad_norm: the reported epsilon is false"
        self._installed = True


def dp_optimizer_of(trainer: pl.Trainer, user: str) -> tuple[DPStrategyMixin, DPOptimizer]:
    """The trainer's DP strategy and its single DP optimizer (wrapped at train start).

    Raises:
        TypeError: the strategy is not a DP strategy.
        ValueError: several processes, not exactly one DP optimizer, adaptive clipping or clipping groups (the
            audits and controls assume one clipping bound for the whole gradient and run).
    """
    strategy = trainer.strategy
    if not isinstance(strategy, DPStrategyMixin):
        raise TypeError(f"{user} works on DPStrategy runs, the trainer uses {type(strategy).__name__}")
    if trainer.world_size > 1:
        raise ValueError(f"{user} runs on one process: use DPStrategy, not DPDDPStrategy")
    if strategy.privacy_engine.config.adaptive_clipping:
        raise ValueError(
            f"{user} assumes one clipping bound for the whole run, and adaptive clipping (target_unclipped_quantile) "
            "moves it: audit the run at a fixed max_grad_norm"
        )
    if strategy.privacy_engine.config.clipping_groups is not None:
        raise ValueError(
            f"{user} assumes one clipping bound for the whole gradient, and clipping_groups clips each group to its "
            "own: audit the run with clipping_groups=None"
        )
    optimizers = [opt for opt in strategy.optimizers if isinstance(opt, DPOptimizer)]
    if len(optimizers) != 1:
        raise ValueError(f"{user} needs exactly one DP optimizer, found {len(optimizers)}")
    return strategy, optimizers[0]
