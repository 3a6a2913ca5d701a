"""Ready-made audit targets: a small linear classifier on synthetic data (the cheap white-box setting) and the
digits CNN of :mod:`lightning_dp.tasks.digits`, each returning the training set, the LightningModule, for input
canaries the candidate canary examples and, for clipped gradient canaries, the unused input features and the layer
they enter."""

from __future__ import annotations

from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from lightning_dp.audit.clipped import per_sample_loss_with_canaries

SETUPS = ("linear", "digits")
#: input canary candidates: ``"mislabelled"`` data points, or ``"orthogonal"`` ones on features the data never uses.
INPUT_CANDIDATES = ("mislabelled", "orthogonal")
#: input scale of the ``"orthogonal"`` input canaries (their input is this times one unused feature).
ORTHOGONAL_INPUT_SCALE = 10.0


class LinearClassifier(pl.LightningModule):
    """``Linear(features, classes)`` trained with SGD on a per-sample cross-entropy. Input ``[B, features]``.

    A row with a negative label ``-1 - k`` is a clipped gradient canary (:mod:`lightning_dp.audit.clipped`): its
    loss is ``logit_k``, linear in the parameters (:func:`~lightning_dp.audit.clipped.per_sample_loss_with_canaries`).

    Args:
        features: input width; classes: number of labels; lr: SGD learning rate.
    """

    def __init__(self, features: int, classes: int, lr: float = 0.5) -> None:
        super().__init__()
        self.layer = nn.Linear(features, classes)
        self.lr = lr

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return per_sample_loss_with_canaries(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


@dataclass
class AuditSetup:
    """What an audit trains: ``module`` on ``train_set``; ``candidates`` are the input canaries (examples the model
    would not otherwise fit); ``canary_coordinates`` the coordinates gradient canaries are drawn from (``None``:
    all); ``unused_features`` the input features of ``module.get_submodule(canary_layer)`` (an ``nn.Linear`` fed
    with the input) that the data never uses, where clipped gradient canaries go (``None``: the setup has none)."""

    module: pl.LightningModule
    train_set: Dataset
    candidates: TensorDataset
    canary_coordinates: torch.Tensor | None = None
    unused_features: torch.Tensor | None = None
    canary_layer: str | None = None


def make_setup(
    name: str, *, seed: int = 0, num_candidates: int = 200, input_candidates: str = "mislabelled"
) -> AuditSetup:
    """Build the ``"linear"`` or ``"digits"`` setup.

    ``"linear"``: N = 1000 Gaussian inputs with 50 informative features and 200 always-zero ones (an input block the
    data never uses, as unused vocabulary rows of an embedding), 10 classes from a random linear teacher; 2510
    parameters. Gradient canaries go to the 2000 weights of the unused inputs, which receive only noise and canaries:
    the white-box setting in which the one-run audit is tightest (Steinke et al. 2023, Section 7). Clipped gradient
    canaries use the same unused features (``unused_features``, layer ``"layer"``). Input candidates:
    ``"mislabelled"``, data points with a wrong label; ``"orthogonal"``, the input ``10 e_j`` for distinct unused
    features ``j`` (at most 200 candidates) with a random label, whose gradient only noise and the canary itself move.
    ``"digits"``: sklearn digits train split with ``DigitsCNN``; gradient canaries anywhere; mislabelled input
    candidates from the test split.

    Raises:
        ValueError: an unknown name or ``input_candidates``, ``"orthogonal"`` candidates outside the linear setup or
            more than 200 of them.
    """
    if name not in SETUPS:
        raise ValueError(f"Unknown audit setup {name!r}; choose one of {SETUPS}")
    if input_candidates not in INPUT_CANDIDATES:
        raise ValueError(f"input_candidates must be one of {INPUT_CANDIDATES}, got {input_candidates!r}")
    if input_candidates == "orthogonal" and name != "linear":
        raise ValueError("orthogonal input canaries need unused input features: use the linear setup")
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
        if input_candidates == "orthogonal":
            if num_candidates > unused:
                raise ValueError(
                    f"at most {unused} orthogonal input canaries (one per unused feature), got {num_candidates}"
                )
            features = used + torch.randperm(unused, generator=generator)[:num_candidates]
            rows = torch.zeros(num_candidates, width)
            rows[torch.arange(num_candidates), features] = ORTHOGONAL_INPUT_SCALE
            candidates = TensorDataset(rows, torch.randint(classes, (num_candidates,), generator=generator))
        unused_weights = (torch.arange(classes)[:, None] * width + torch.arange(used, width)[None, :]).flatten()
        with torch.random.fork_rng():  # seeded initial weights, without touching the caller's global RNG state
            torch.manual_seed(seed)
            module = LinearClassifier(width, classes)
        return AuditSetup(module, train, candidates, unused_weights, torch.arange(used, width), "layer")
    from lightning_dp.tasks.digits import DigitsCNN, DigitsDataModule

    data = DigitsDataModule(split_seed=seed)
    data.setup()
    x, y = (torch.stack(t) for t in zip(*(data.test_set[i] for i in range(len(data.test_set))), strict=True))
    count = min(num_candidates, len(y))
    candidates = TensorDataset(x[:count], (y[:count] + 1) % 10)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return AuditSetup(DigitsCNN(lr=0.5, momentum=0.0), data.train_set, candidates)
