"""The demo task: a small CNN on scikit-learn's handwritten digits (1,797 8x8 images shipped with sklearn; offline)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split


class DigitsDataModule(pl.LightningDataModule):
    """scikit-learn digits as ``[B, 1, 8, 8]`` float tensors in [0, 1] with integer labels.

    Args:
        batch_size: training batch size (the expected Poisson batch size under ``DPStrategy``).
        val_fraction: share of examples for validation.
        test_fraction: share of examples for the final test.
        split_seed: seed of the split (fixed, so runs are comparable).
    """

    def __init__(
        self,
        batch_size: int = 128,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        split_seed: int = 0,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.split_seed = split_seed

    def setup(self, stage: str | None = None) -> None:
        images, labels = load_digits(return_X_y=True)
        x = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
        dataset = TensorDataset(x, torch.tensor(labels, dtype=torch.long))
        n_test = round(len(dataset) * self.test_fraction)
        n_val = round(len(dataset) * self.val_fraction)
        lengths = [len(dataset) - n_val - n_test, n_val, n_test]
        generator = torch.Generator().manual_seed(self.split_seed)
        self.train_set, self.val_set, self.test_set = random_split(dataset, lengths, generator=generator)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=512)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.test_set, batch_size=512)


class DigitsCNN(pl.LightningModule):
    """Two 3x3 convolutions with tanh (Papernot et al. 2021, tempered activations), GroupNorm and a linear classifier
    (about 10k parameters). Input ``[B, 1, 8, 8]``, output logits ``[B, 10]``.

    Args:
        lr: SGD learning rate.
        momentum: SGD momentum.
        channels: channels of the two convolutions.
    """

    def __init__(self, lr: float = 1.0, momentum: float = 0.5, channels: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1),
            nn.GroupNorm(4, channels),
            nn.Tanh(),
            nn.Conv2d(channels, 2 * channels, 3, padding=1),
            nn.GroupNorm(4, 2 * channels),
            nn.Tanh(),
            nn.AvgPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * channels * 16, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y, reduction="none")  # per-sample loss, shape [B]
        return loss

    def _accuracy(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return (self(x).argmax(dim=1) == y).float().mean()

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_acc", self._accuracy(batch), prog_bar=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("test_acc", self._accuracy(batch))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=self.hparams.momentum)
