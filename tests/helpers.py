"""Small LightningModules and data shared by the integration tests, and a comparison of nested states."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def regression_data(n: int = 64, d: int = 6, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = x @ torch.randn(d, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


class TinyRegressor(pl.LightningModule):
    """Linear -> tanh -> Linear with per-sample squared error; optional mean-reduction (a non-DP loss)."""

    def __init__(
        self,
        d: int = 6,
        lr: float = 0.1,
        batch_size: int = 8,
        per_sample: bool = True,
        shuffle: bool = False,
        scheduler: bool = False,
        data: TensorDataset | None = None,
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, 8), nn.Tanh(), nn.Linear(8, 1))
        self.lr, self.batch_size, self.per_sample, self.shuffle = lr, batch_size, per_sample, shuffle
        self.scheduler = scheduler
        self.data = data if data is not None else regression_data(d=d)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self.net(x) - y) ** 2).squeeze(-1)
        return loss if self.per_sample else loss.mean()

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size, shuffle=self.shuffle)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        if not self.scheduler:
            return opt
        return {
            "optimizer": opt,
            "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        }


class ZeroGradModule(pl.LightningModule):
    """A wide linear layer whose loss has zero gradient: every update is pure noise."""

    def __init__(self, d: int = 400, k: int = 250, n: int = 100, batch_size: int = 10) -> None:
        super().__init__()
        self.layer = nn.Linear(d, k, bias=False)
        nn.init.zeros_(self.layer.weight)
        self.data = TensorDataset(torch.randn(n, d))
        self.batch_size = batch_size

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return (self.layer(x) * 0.0).sum(dim=1)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


class ClassifierWith(pl.LightningModule):
    """A classifier built around a given feature module (to test unsupported layers)."""

    def __init__(self, body: nn.Module, d: int = 6) -> None:
        super().__init__()
        self.body = body
        self.data = regression_data(d=d)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.body(x), y.expand(-1, 1), reduction="none").squeeze(-1)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def make_trainer(strategy, **kwargs) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return pl.Trainer(strategy=strategy, **defaults)


def nested_equal(a: object, b: object) -> bool:
    """Whether two nested containers (dicts, lists, tuples) are equal, tensors by ``torch.equal`` and numpy arrays by
    ``numpy.array_equal`` (bit for bit)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, Mapping):
        return isinstance(b, Mapping) and a.keys() == b.keys() and all(nested_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return (
            isinstance(b, list | tuple)
            and len(a) == len(b)
            and all(nested_equal(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


def parameter_fingerprint(module: nn.Module | Mapping[str, torch.Tensor], values: bool = False) -> dict:
    """``sha256`` over the state_dict (of a module, or a state_dict itself) in key order (each key, then its tensor's
    float32 bytes), plus each tensor's float64 sum: the hash compares bit-exactly, the sums show which tensors moved
    and by how much. ``values=True`` adds ``values``: the hashed float32 CPU tensors themselves (copies), so a caller
    can store them and compare within a tolerance; the hash of stored values recomputes with this function."""
    state = module.state_dict() if isinstance(module, nn.Module) else module
    digest = hashlib.sha256()
    sums, copies = {}, {}
    for key, tensor in state.items():
        tensor = tensor.detach().to("cpu", torch.float32).contiguous()
        digest.update(key.encode())
        digest.update(tensor.numpy().tobytes())
        sums[key] = float(tensor.double().sum())
        if values:
            copies[key] = tensor.clone()
    return {"sha256": digest.hexdigest(), "sums": sums, **({"values": copies} if values else {})}


class ClipBoundRecorder(pl.Callback):
    """Records, as each training batch starts, the bound the clipper clips it at (:attr:`bounds`) and the bound the
    clipped sum's noise is scaled to (:attr:`noised_at`); one entry per optimizer step without accumulation."""

    def __init__(self) -> None:
        self.bounds: list[float] = []
        self.noised_at: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        engine = trainer.strategy.privacy_engine
        self.bounds.append(engine.clipper.max_grad_norm)
        self.noised_at.append(engine.sum_mechanism.max_grad_norm)


class BatchIndexRecorder(pl.Callback):
    """Records, as each training batch starts, the dataset indices of its examples (:attr:`batches`, one sorted list
    per batch), found by matching the batch's inputs against ``inputs`` (``[N, d]``, rows distinct)."""

    def __init__(self, inputs: torch.Tensor) -> None:
        self.inputs = inputs
        self.batches: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        x = batch[0].detach().cpu()
        matches = (x[:, None, :] == self.inputs[None, :, :]).all(-1).nonzero()[:, 1]
        assert len(matches) == len(x), "a batch row matches no example, or several"
        self.batches.append(sorted(matches.tolist()))


class CoshModule(pl.LightningModule):
    """The reproduction as a training run: ``nn.Linear(3, 2)``, loss ``cosh(out).sum(-1)``, example 3 set to 1e3
    (its float32 loss is inf)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(3, 2)
        x = torch.randn(50, 3)
        x[3] = 1e3
        self.data = TensorDataset(x)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return torch.cosh(self.layer(x)).sum(-1)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=10)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


# ---------------------------------------------------- the options of scripts/ddp_fit_script.py (--users, --adaptive)
def example_user(example: tuple[torch.Tensor, torch.Tensor]) -> int:
    """One of 10 users, a function of the example's first input."""
    return int(abs(float(example[0][0])) * 1000) % 10


#: the privacy options of ``--users`` (tests/engine/test_ddp.py trains the same on one process).
USER_OPTIONS = {"privacy_unit": "user", "user_key": example_user, "examples_per_user": 4}
#: the privacy options of ``--adaptive``: seeded, and q = 1, so that every step's Poisson sample is the whole data set
#: on any number of processes (tests/engine/test_ddp.py trains the same on one process and compares the bounds).
ADAPTIVE_OPTIONS = {"seed": 0, "sample_rate": 1.0, "target_unclipped_quantile": 0.5}
