"""Ready-made audit targets: a small linear classifier on synthetic data (the cheap white-box setting) and the
digits CNN of :mod:`lightning_dp.examples.digits`, each returning the training set, the LightningModule and, for
input canaries, the candidate canary examples."""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

SETUPS = ("linear", "digits")


class LinearClassifier(pl.LightningModule):
    """``Linear(features, classes)`` trained with SGD on a per-sample cross-entropy. Input ``[B, features]``.

    Args:
        features: input width; classes: number of labels; lr: SGD learning rate.
    """

    def __init__(self, features: int, classes: int, lr: float = 0.5) -> None:
        super().__init__()
        self.layer = nn.Linear(features, classes)
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.layer(x), y, reduction="none")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


@dataclass
class AuditSetup:
    """What an audit trains: ``module`` on ``train_set``; ``candidates`` are the input canaries (mislabelled
    examples the model would not otherwise fit); ``canary_coordinates`` the coordinates gradient canaries are drawn
    from (``None``: all)."""

    module: pl.LightningModule
    train_set: Dataset
    candidates: TensorDataset
    canary_coordinates: torch.Tensor | None = None


def make_setup(name: str, *, seed: int = 0, num_candidates: int = 200) -> AuditSetup:
    """Build the ``"linear"`` or ``"digits"`` setup.

    ``"linear"``: N = 1000 Gaussian inputs with 50 informative features and 200 always-zero ones (an input block the
    data never uses, as unused vocabulary rows of an embedding), 10 classes from a random linear teacher; 2510
    parameters. Gradient canaries go to the 2000 weights of the unused inputs, which receive only noise and canaries:
    the white-box setting in which the one-run audit is tightest (Steinke et al. 2023, Section 7).
    ``"digits"``: sklearn digits train split with ``DigitsCNN``; gradient canaries anywhere; input candidates
    from the test split.

    Raises:
        ValueError: an unknown name.
    """
    if name not in SETUPS:
        raise ValueError(f"Unknown audit setup {name!r}; choose one of {SETUPS}")
    generator = torch.Generator().manual_seed(seed)
    if name == "linear":
        used, unused, classes = 50, 200, 10
        teacher = torch.randn(used, classes, generator=generator)
        x = torch.cat(
            [
                torch.randn(1000 + num_candidates, used, generator=generator),
                torch.zeros(1, unused).expand(1000 + num_candidates, -1),
            ],
            1,
        )
        y = (x[:, :used] @ teacher).argmax(dim=1)
        train = TensorDataset(x[:1000], y[:1000])
        candidates = TensorDataset(x[1000:], (y[1000:] + 1) % classes)
        width = used + unused
        unused_weights = (torch.arange(classes)[:, None] * width + torch.arange(used, width)[None, :]).flatten()
        with torch.random.fork_rng():  # seeded initial weights, without touching the caller's global RNG state
            torch.manual_seed(seed)
            module = LinearClassifier(width, classes)
        return AuditSetup(module, train, candidates, unused_weights)
    from lightning_dp.examples.digits import DigitsCNN, DigitsDataModule

    data = DigitsDataModule(split_seed=seed)
    data.setup()
    x, y = (torch.stack(t) for t in zip(*(data.test_set[i] for i in range(len(data.test_set))), strict=True))
    count = min(num_candidates, len(y))
    candidates = TensorDataset(x[:count], (y[:count] + 1) % 10)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AuditSetup(DigitsCNN(lr=0.5, momentum=0.0), data.train_set, candidates)
