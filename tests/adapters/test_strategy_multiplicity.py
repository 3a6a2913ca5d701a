"""Augmentation multiplicity through Lightning (``DPStrategy(augmentation_multiplicity=K)``; De et al. 2022, Section
3.2): a training step that makes and augments K copies of each example trains and reports; identical copies train
exactly as K = 1; K = 1 is the strategy of before bit for bit; a loss per copy, copies made by the data loader, and
copies in copy-major order are refused before anything is released; per-sample momentum; the option on every
surface."""

from __future__ import annotations

import logging

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import make_trainer, parameter_fingerprint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy, augmentation_mean, repeat_for_multiplicity
from lightning_dp.checks.independence import BatchMixingError
from lightning_dp.config import PrivacyConfig
from lightning_dp.hf import PrivacyArguments

K = 3


def _images(n: int = 48, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 2, 6, 6, generator=generator), torch.randint(0, 3, (n,), generator=generator))


class AugmentedClassifier(pl.LightningModule):
    """Conv -> GroupNorm -> Linear; ``training_step`` makes ``copies`` copies of each image and adds per-row noise
    (the "augmentation", in train mode only, from a generator keyed by the batch index: re-runs of a micro-batch
    see the same copies). ``order``: ``"sample"`` (right), ``"copy"`` (copy-major, wrong), ``"per_copy"`` (a loss per
    copy, wrong); ``augment=False`` makes identical copies."""

    def __init__(self, copies: int = K, order: str = "sample", augment: bool = True, loader_copies: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(), nn.Linear(64, 3))
        self.copies, self.order, self.augment, self.loader_copies = copies, order, augment, loader_copies
        self.seen_rows: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.order == "copy":
            x, y = x.repeat(self.copies, 1, 1, 1), y.repeat(self.copies)
        elif self.loader_copies == 1:
            x, y = repeat_for_multiplicity((x, y), self.copies)
        if self.augment and self.training:
            generator = torch.Generator().manual_seed(1000 + batch_idx)
            x = x + 0.5 * torch.randn(x.shape, generator=generator)
        self.seen_rows.append(x.shape[0])
        rows = F.cross_entropy(self.net(x), y, reduction="none")
        if self.order == "per_copy":
            return rows
        if self.order == "copy":
            return rows.reshape(self.copies, -1).mean(0)
        return augmentation_mean(rows, self.copies * self.loader_copies)

    def train_dataloader(self):
        data = _images()
        if self.loader_copies == 1:
            return DataLoader(data, batch_size=8)

        def collate(items):  # the copies made by the loader (refused)
            x, y = torch.utils.data.default_collate(items)
            return repeat_for_multiplicity((x, y), self.loader_copies)

        return DataLoader(data, batch_size=8, collate_fn=collate)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def _fit(module: pl.LightningModule, max_steps: int = 3, **options) -> DPStrategy:
    strategy = DPStrategy(**{"noise_multiplier": 1.0, "seed": 0, "max_grad_norm": 0.1, **options})
    make_trainer(strategy, max_steps=max_steps).fit(module)
    return strategy


def test_copies_train_and_report(caplog: pytest.LogCaptureFixture) -> None:
    module = AugmentedClassifier()
    before = parameter_fingerprint(module)
    with caplog.at_level(logging.INFO, logger="lightning_dp"):
        strategy = _fit(module, augmentation_multiplicity=K)
    assert parameter_fingerprint(module)["sha256"] != before["sha256"]
    summary = strategy.privacy_engine.summary()
    assert summary["augmentation_multiplicity"] == K and summary["steps"] == 3
    assert 0 < strategy.get_epsilon() < float("inf")
    assert "3 copies per example (augmentation multiplicity), averaged before clipping" in caplog.text
    assert module.seen_rows and all(rows % K == 0 for rows in module.seen_rows)


def test_identical_copies_train_exactly_as_one_copy() -> None:
    """Without augmentation, the average of K equal gradients is the gradient: the same Poisson batches, clip
    factors and noise give the same parameters as K = 1 (up to float rounding)."""
    states = []
    for copies in (1, K):
        module = AugmentedClassifier(copies=copies, augment=False)
        _fit(module, augmentation_multiplicity=copies)
        states.append(module.state_dict())
    for name, value in states[0].items():
        torch.testing.assert_close(states[1][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_multiplicity_one_is_the_strategy_of_before_bit_for_bit() -> None:
    runs = [
        parameter_fingerprint(_fit(AugmentedClassifier(copies=1), **options).lightning_module)
        for options in ({}, {"augmentation_multiplicity": 1})
    ]
    assert runs[0] == runs[1]


def test_per_sample_momentum_over_copies_trains() -> None:
    """The re-runs at the stored iterate see the same copies (the augmentation's generator is keyed by the batch),
    so the momentum's row check passes, and each example's clipped momentum covers its copies at both iterates."""
    module = AugmentedClassifier()
    strategy = _fit(module, augmentation_multiplicity=K, momentum_length=2)
    assert strategy.privacy_engine.summary()["momentum_length"] == 2


def test_a_loss_per_copy_is_refused() -> None:
    with pytest.raises(
        ValueError,
        match=r"returned \d+ per-sample losses for a batch of \d+ examples, one per augmented copy.*"
        r"augmentation_mean\(loss, 3\)",
    ):
        _fit(AugmentedClassifier(order="per_copy"), augmentation_multiplicity=K)


def test_copies_made_by_the_data_loader_are_refused() -> None:
    with pytest.raises(
        ValueError, match=r"the training batch has \d+ rows for \d+ per-sample losses.*inside training_step"
    ):
        _fit(AugmentedClassifier(copies=1, loader_copies=K), augmentation_multiplicity=K)


def test_copies_in_copy_major_order_are_refused_on_the_first_step() -> None:
    module = AugmentedClassifier(order="copy")
    before = parameter_fingerprint(module)
    with pytest.raises(BatchMixingError, match=r"repeat_interleave\(3, 0\), not x.repeat\(3, ...\)"):
        _fit(module, augmentation_multiplicity=K)
    assert parameter_fingerprint(module) == before


def test_a_strategy_without_the_option_refuses_the_copies() -> None:
    with pytest.raises(ValueError, match=r"saw a batch dimension of \d+ but the per-sample loss has \d+ samples"):
        _fit(AugmentedClassifier(), check_batch_independence=False)


@pytest.mark.parametrize("value", [0, 2.5, True])
def test_the_option_is_validated_on_every_surface(value: object) -> None:
    for make in (
        lambda: PrivacyConfig(noise_multiplier=1.0, augmentation_multiplicity=value),
        lambda: DPStrategy(noise_multiplier=1.0, augmentation_multiplicity=value),
        lambda: PrivacyArguments(noise_multiplier=1.0, augmentation_multiplicity=value),
    ):
        with pytest.raises(ValueError, match="augmentation_multiplicity must be an integer >= 1"):
            make()


def test_the_clipped_canary_audit_refuses_copies() -> None:
    """Its canaries' gradients are built from one row each, which augmented copies would change."""
    from lightning_dp.audit import ClippedGradientCanaries, ClippedGradientCanaryAudit
    from lightning_dp.audit.setups import make_setup

    setup = make_setup("linear")
    canaries = ClippedGradientCanaries(10, features=setup.unused_features, width=250, classes=10, input_scale=20.0)
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, augmentation_multiplicity=2)
    trainer = make_trainer(strategy, max_steps=1, callbacks=[ClippedGradientCanaryAudit(canaries, layer="layer")])
    with pytest.raises(ValueError, match="augmentation_multiplicity=2.*GradientCanaryAudit"):
        trainer.fit(setup.module, train_dataloaders=DataLoader(canaries.training_set(setup.train_set), batch_size=50))
