"""One audited DP training run end to end (used by ``lightning-dp audit``, ``bench/audit.py`` and the tests)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from lightning_dp.audit.callback import GradientCanaryAudit, ScaleNoiseForTesting
from lightning_dp.audit.inputs import InputCanaries
from lightning_dp.audit.report import AuditReport, report_for
from lightning_dp.audit.setups import make_setup
from lightning_dp.lightning import DPStrategy

MODES = ("gradient", "input")


@dataclass(frozen=True)
class AuditConfig:
    """One audited run.

    Attributes:
        setup: ``"linear"`` or ``"digits"`` (:func:`~lightning_dp.audit.setups.make_setup`).
        mode: ``"gradient"`` (white-box Dirac canaries) or ``"input"`` (mislabelled examples, loss scores).
        noise: mechanism name; target_epsilon, target_delta: the budget the noise is calibrated for.
        num_canaries: m; epochs: training epochs; batch_size: expected Poisson batch size; max_grad_norm: C.
        confidence: stated confidence of the bound.
        guess_sets: ``(k_plus, k_minus)`` pairs (default :func:`~lightning_dp.audit.one_run.default_guess_sets`).
        noise_factor_for_testing: TEST-ONLY broken control (:class:`~lightning_dp.audit.callback.ScaleNoiseForTesting`).
        seed: seeds the data, the initial weights, the DP generators and the audit's generator.
    """

    setup: str = "linear"
    mode: str = "gradient"
    noise: str = "gaussian"
    target_epsilon: float = 4.0
    target_delta: float = 1e-5
    num_canaries: int = 1000
    epochs: int = 10
    batch_size: int = 100
    max_grad_norm: float = 1.0
    confidence: float = 0.95
    guess_sets: Sequence[tuple[int, int]] | None = None
    noise_factor_for_testing: float | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("num_canaries", "epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def run_audit(config: AuditConfig, **trainer_kwargs: Any) -> AuditReport:
    """Train ``config.setup`` once under ``DPStrategy`` with the canaries and return the audit next to the
    reported epsilon (Steinke, Nasr & Jagielski 2023, Algorithm 1).

    Args:
        config: the run.
        trainer_kwargs: extra ``lightning.Trainer`` arguments.

    Raises:
        ValueError: invalid configuration (unknown setup or mode, too many canaries, invalid privacy arguments).
    """
    setup = make_setup(config.setup, seed=config.seed, num_candidates=config.num_canaries)
    callbacks: list[pl.Callback] = []
    if config.noise_factor_for_testing is not None:
        callbacks.append(ScaleNoiseForTesting(config.noise_factor_for_testing))
    train_set = setup.train_set
    if config.mode == "gradient":
        audit = GradientCanaryAudit(config.num_canaries, seed=config.seed, coordinates=setup.canary_coordinates)
        callbacks.append(audit)
    else:
        inputs = InputCanaries(setup.candidates, seed=config.seed)
        train_set = inputs.training_set(train_set)
    strategy = DPStrategy(
        target_epsilon=config.target_epsilon,
        target_delta=config.target_delta,
        noise=config.noise,
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
    if config.mode == "gradient":
        return audit.report(confidence=config.confidence, guess_sets=config.guess_sets)
    module = setup.module.eval()
    scores = inputs.scores(lambda batch: module.training_step(batch, 0))
    return report_for(
        strategy.privacy_engine, scores, inputs.included.numpy(), "input", config.confidence, config.guess_sets
    )
