"""Everyday use with Lightning (docs/usage.md): DP-SGD added to a plain ``Trainer``, epsilon read back, and the
privacy curve logged to TensorBoard.

A two-layer network on scikit-learn's handwritten digits (no download), 5 epochs of expected batch 128, the noise
calibrated for epsilon = 3 at delta = 1e-5. Usage::

    pip install -e ".[examples]"   # once
    python -m lightning_dp.examples.quickstart_lightning [--logdir dp_logs]

It prints a progress line every 10 steps, the validation accuracy, epsilon at the run's delta and at another one,
and the privacy summary; TensorBoard finds the per-epoch ``epsilon`` scalar and the ``privacy/epsilon_curve`` image
under ``--logdir``.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger
from torch import nn

from lightning_dp import DPStrategy, PrivacyAccountantCallback, TrainingProgress
from lightning_dp.tasks.digits import DigitsDataModule
from lightning_dp.utils.help_format import HelpFormatter


class Classifier(pl.LightningModule):
    """An MLP on the 8x8 digits; what DP needs of it is one loss per example from ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y, reduction="none")  # shape [B]: one loss per example

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.5)


def main(argv: list[str] | None = None) -> None:
    """Train, then print epsilon and the privacy summary (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--logdir", default="dp_logs", help="TensorBoard log folder")
    args = parser.parse_args(argv)
    pl.seed_everything(0, verbose=False)
    strategy = DPStrategy(target_epsilon=3.0, target_delta=1e-5, max_grad_norm=1.0, seed=0)  # seed: reproducible docs
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=5,
        callbacks=[PrivacyAccountantCallback(), TrainingProgress()],
        logger=TensorBoardLogger(args.logdir, name="digits"),
        log_every_n_steps=10,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(Classifier(), datamodule=DigitsDataModule(batch_size=128))
    print(f"val_acc = {float(trainer.callback_metrics['val_acc']):.3f}")
    print(f"epsilon = {strategy.get_epsilon():.3f} at the run's delta, {strategy.get_epsilon(delta=1e-6):.3f} at 1e-6")
    print(strategy.privacy_summary())


if __name__ == "__main__":
    main()
