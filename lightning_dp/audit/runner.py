"""One audited DP training run end to end (used by ``lightning-dp audit``, ``bench/audit.py`` and the tests)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_dp.audit.callback import (
    ClippedGradientCanaryAudit,
    GradientCanaryAudit,
    ScaleClippingForTesting,
    ScaleNoiseForTesting,
)
from lightning_dp.audit.clipped import ClippedGradientCanaries
from lightning_dp.audit.inputs import InputCanaries
from lightning_dp.audit.report import AuditReport, report_for
from lightning_dp.audit.setups import INPUT_CANDIDATES, make_setup
from lightning_dp.lightning import DPStrategy

MODES = ("gradient", "clipped-gradient", "input")


@dataclass(frozen=True)
class AuditConfig:
    """One audited run.

    Attributes:
        setup: ``"linear"`` or ``"digits"`` (:func:`~lightning_dp.audit.setups.make_setup`).
        mode: ``"gradient"`` (white-box Dirac canaries added to the clipped sum after clipping: catches noise and
            accounting bugs, never a clipping bug), ``"clipped-gradient"`` (white-box canary examples whose
            gradient, of norm ``canary_norm * C``, the run's clipper clips: also catches clipping bugs; linear setup
            only) or ``"input"`` (candidate examples, scored by their loss decrease).
        noise: mechanism name; target_epsilon, target_delta: the budget the noise is calibrated for.
        clipping: the clipping engine (default ``"auto"``, as ``DPStrategy``'s; the report names the one that ran).
        num_canaries: m; epochs: training epochs; batch_size: expected Poisson batch size; max_grad_norm: C.
        canary_norm: ``"clipped-gradient"`` canaries' input scale in units of C (their gradient's l2 norm is
            ``sqrt((canary_norm C)^2 + 1)``); must exceed 1 so that clipping acts (default 10).
        input_candidates: ``"mislabelled"`` or ``"orthogonal"`` input canaries
            (:func:`~lightning_dp.audit.setups.make_setup`).
        confidence: stated confidence of the bound.
        guess_sets: ``(k_plus, k_minus)`` pairs (default :func:`~lightning_dp.audit.one_run.default_guess_sets`).
        noise_factor_for_testing: TEST-ONLY broken noise (:class:`~lightning_dp.audit.callback.ScaleNoiseForTesting`).
        clipping_factor_for_testing: TEST-ONLY broken clipper, clipping to this factor times C
            (:class:`~lightning_dp.audit.callback.ScaleClippingForTesting`).
        seed: seeds the data, the initial weights, the DP generators and the audit's generator.

    Raises:
        ValueError: an unknown mode or input candidates, a count below 1, or ``canary_norm <= 1``.
    """

    setup: str = "linear"
    mode: str = "gradient"
    noise: str = "gaussian"
    clipping: str = "auto"
    target_epsilon: float = 4.0
    target_delta: float = 1e-5
    num_canaries: int = 1000
    epochs: int = 10
    batch_size: int = 100
    max_grad_norm: float = 1.0
    canary_norm: float = 10.0
    input_candidates: str = "mislabelled"
    confidence: float = 0.95
    guess_sets: Sequence[tuple[int, int]] | None = None
    noise_factor_for_testing: float | None = None
    clipping_factor_for_testing: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.input_candidates not in INPUT_CANDIDATES:
            raise ValueError(f"input_candidates must be one of {INPUT_CANDIDATES}, got {self.input_candidates!r}")
        if not self.canary_norm > 1.0:
            raise ValueError(f"canary_norm must exceed 1 (in units of C) so that clipping acts, got {self.canary_norm}")
        for name in ("num_canaries", "epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def run_audit(config: AuditConfig, **trainer_kwargs: Any) -> AuditReport:
    """Train ``config.setup`` once under ``DPStrategy`` with the canaries and return the audit next to the
    reported epsilon (Steinke, Nasr & Jagielski 2023, Algorithm 1).

    Args:
        config: the run.
        trainer_kwargs: extra ``lightning.Trainer`` arguments.

    Input canaries are scored by their loss decrease, loss under the initial model minus loss after training (two
    black-box queries; the difference removes the spread of the initial weights from the scores).

    Raises:
        ValueError: invalid configuration (unknown setup or mode, too many canaries, invalid privacy arguments,
            clipped gradient canaries on a setup without unused input features).
    """
    setup = make_setup(
        config.setup,
        seed=config.seed,
        num_candidates=config.num_canaries,
        input_candidates=config.input_candidates if config.mode == "input" else "mislabelled",
    )
    callbacks: list[pl.Callback] = []
    if config.noise_factor_for_testing is not None:
        callbacks.append(ScaleNoiseForTesting(config.noise_factor_for_testing))
    if config.clipping_factor_for_testing is not None:
        callbacks.append(ScaleClippingForTesting(config.clipping_factor_for_testing))
    train_set = setup.train_set
    audit: GradientCanaryAudit | ClippedGradientCanaryAudit
    if config.mode == "gradient":
        audit = GradientCanaryAudit(config.num_canaries, seed=config.seed, coordinates=setup.canary_coordinates)
        callbacks.append(audit)
    elif config.mode == "clipped-gradient":
        if setup.unused_features is None or setup.canary_layer is None:
            raise ValueError(f"clipped gradient canaries need unused input features; setup {config.setup!r} has none")
        layer = setup.module.get_submodule(setup.canary_layer)
        canaries = ClippedGradientCanaries(
            config.num_canaries,
            features=setup.unused_features,
            width=layer.in_features,
            classes=layer.out_features,
            input_scale=config.canary_norm * config.max_grad_norm,
            seed=config.seed,
        )
        train_set = canaries.training_set(train_set)
        audit = ClippedGradientCanaryAudit(canaries, layer=setup.canary_layer)
        callbacks.append(audit)
    else:
        inputs = InputCanaries(setup.candidates, seed=config.seed)
        train_set = inputs.training_set(train_set)
        initial = inputs.scores(lambda batch: setup.module.training_step(batch, 0))
    strategy = DPStrategy(
        target_epsilon=config.target_epsilon,
        target_delta=config.target_delta,
        noise=config.noise,
        clipping=config.clipping,
        max_grad_norm=config.max_grad_norm,
        seed=config.seed,
    )
    trainer = pl.Trainer(
        strategy=strategy,
        max_epochs=config.epochs,
        callbacks=callbacks,
        **{
            "accelerator": "cpu",
            "logger": False,
            "enable_checkpointing": False,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            **trainer_kwargs,
        },
    )
    trainer.fit(setup.module, train_dataloaders=DataLoader(train_set, batch_size=config.batch_size))
    if config.mode != "input":
        return audit.report(confidence=config.confidence, guess_sets=config.guess_sets)
    module = setup.module.eval()
    scores = inputs.scores(lambda batch: module.training_step(batch, 0)) - initial
    return report_for(
        strategy.privacy_engine, scores, inputs.included.numpy(), "input", config.confidence, config.guess_sets
    )
