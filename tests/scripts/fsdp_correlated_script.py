"""Run by tests/correlated_noise/test_correlated_fsdp.py: ``python fsdp_correlated_script.py OUT_DIR`` trains, under
DPModelParallelStrategy on 2 CPU processes (gloo, Lightning's own launcher), a 3-layer MLP sharded with
``fully_shard`` on each layer and the root, whose loss has zero gradient (every update is pure noise), with SGD at
learning rate 1, q = 1/2 (64 examples, per-rank batch 16), seed 7, 6 steps, three times: ``"independent"``
(``noise_correlation=None``), ``"banded"`` (``correlation_band=2``) and ``"blt"`` (``correlation_buffers=2``). Each
rank writes ``OUT_DIR/rank{r}.pt``: per run the gathered parameters after every step (the first entry: before
training), the expected batch ``q N``, the plan's strategy and scale ``s`` (``None`` for independent noise), the
engine's epsilon and the privacy summary. Then, under ``"exact"``, on the 1-D mesh (``"fsdp"``) and on a (2, 1)
HSDP mesh (``"hsdp"``): ``"whole"``, BLT noise (2 buffers) with ``exact_resume=True``, unseeded, 6 steps (3 epochs of
2), a sharded (DCP) checkpoint at the end of each epoch; and ``"resumed"``: a fresh unseeded strategy resumed from its
checkpoint at step 4 (warm buffers) to step 6. Both record the gathered parameters at the start of training (after
the restore) and after every step, and the resumed run also writes a checkpoint at the end of each epoch;
``"checkpoints"`` holds the secret state of the step-4 checkpoint (``"cut"``) and of both runs' step-6 checkpoints
(``"whole end"``, ``"resumed end"``)."""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPModelParallelStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers

from correlation_helpers import zero_gradient_run

WIDTH, EXAMPLES, BATCH, STEPS = 24, 64, 16, 6
RUNS = {
    "independent": {},
    "banded": {"noise_correlation": "banded", "correlation_band": 2},
    "blt": {"noise_correlation": "blt", "correlation_buffers": 2},
}


class ZeroGradMLP(pl.LightningModule):
    """Three linear layers, each sharded, and the root; the per-sample loss is 0 times the output. With ``hsdp``, on
    a (2, 1) mesh: each parameter replicated over the two ranks, sharded over a dimension of size 1."""

    def __init__(self, hsdp: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 3))
        self.data = TensorDataset(torch.randn(EXAMPLES, WIDTH))
        self.hsdp = hsdp

    def configure_model(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        if self.hsdp:
            mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        for layer in self.net:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return (self.net(x) * 0.0).sum(dim=1)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=BATCH)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


def gathered(module: nn.Module) -> torch.Tensor:
    """Every parameter gathered (``full_tensor()``: a collective) and flattened into one vector."""
    full = [(p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten() for p in module.parameters()]
    return torch.cat(full).clone()


class Iterates(Callback):
    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []

    def on_train_start(self, trainer, pl_module) -> None:
        self.params.append(gathered(pl_module.net))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.params.append(gathered(pl_module.net))


def sharded_trainer(strategy: DPModelParallelStrategy, callbacks: list[Callback]) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=any(isinstance(callback, ModelCheckpoint) for callback in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )


def exact_resume(out: Path, hsdp: bool) -> dict:
    """The exact-resume runs (``"whole"``, ``"resumed"``, the resumed run's step count ``"steps"`` and the
    checkpoints' secret states ``"checkpoints"``), on an HSDP mesh with ``hsdp``."""
    exact = {"noise_correlation": "blt", "correlation_buffers": 2, "exact_resume": True}
    out = out / ("hsdp" if hsdp else "fsdp")
    result = {}
    iterates = Iterates()
    saving = ModelCheckpoint(dirpath=out / "ckpt", filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    sharded_trainer(DPModelParallelStrategy(noise_multiplier=0.8, max_grad_norm=1.5, **exact), [iterates, saving]).fit(
        ZeroGradMLP(hsdp)
    )
    result["whole"] = iterates.params
    cut = out / "ckpt" / "epoch=1.ckpt"
    iterates = Iterates()
    saving = ModelCheckpoint(dirpath=out / "ckpt_resumed", filename="{epoch}", every_n_epochs=1, save_top_k=-1)
    strategy = DPModelParallelStrategy(noise_multiplier=0.8, max_grad_norm=1.5, **exact)
    sharded_trainer(strategy, [iterates, saving]).fit(ZeroGradMLP(hsdp), ckpt_path=str(cut))
    result["resumed"] = iterates.params
    result["steps"] = strategy.privacy_engine.steps
    secret = {}
    for name, path in (("cut", cut), ("whole end", out / "ckpt"), ("resumed end", out / "ckpt_resumed")):
        folder = path if name == "cut" else path / "epoch=2.ckpt"
        secret[name] = torch.load(folder / "meta.pt", weights_only=False)["lightning_dp"]["exact_resume"]
    result["checkpoints"] = secret
    return result


if __name__ == "__main__":
    out = Path(sys.argv[1])
    result: dict = {}
    rank = 0
    for name, options in RUNS.items():
        strategy = DPModelParallelStrategy(noise_multiplier=0.8, max_grad_norm=1.5, seed=7, **options)
        iterates = Iterates()
        trainer = sharded_trainer(strategy, [iterates])
        trainer.fit(ZeroGradMLP())
        rank = trainer.global_rank
        result[name] = zero_gradient_run(strategy.privacy_engine, iterates.params, trainer.lightning_module)
    result["exact"] = {"fsdp": exact_resume(out, hsdp=False), "hsdp": exact_resume(out, hsdp=True)}
    torch.save(result, out / f"rank{rank}.pt")
