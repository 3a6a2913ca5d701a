"""Run by tests/adapters/test_physical_batch_cap_processes.py: ``python cap_fit_script.py OUT_DIR`` trains on 2 CPU
processes (gloo) through Lightning's own launcher, each fit with and without ``max_physical_batch_size``:

- ``"sharded"`` / ``"sharded, cap 3"``: a tiny Llama sharded with ``fully_shard`` (each decoder layer and the root)
  under DPModelParallelStrategy, seeded noise, 3 steps; per-rank batch 8 of 32 examples (q = 0.5: a rank's Poisson
  batch is about 8 examples, so its pass count under the cap of 3 varies by step and rank, and the rank with fewer
  passes pads with stand-in batches);
- ``"replicated"`` / ``"replicated, cap 2"``: TinyRegressor under DPDDPStrategy, zero noise, 2 micro-batches per step
  (``accumulate_grad_batches=2``), 3 steps (each rank runs its own number of passes).

Each rank writes ``OUT_DIR/rank{r}.pt``: per fit the gathered parameters at the end, the engine's steps and epsilon,
the sizes of the batches the user's step ran on (with gradients) and, per micro-batch, the passes the strategy ran
(real, stand-in).
"""

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPDDPStrategy, DPModelParallelStrategy
from lightning_dp.hf.losses import token_cross_entropy
from lightning_dp.lightning import dp_mixin

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers

from helpers import TinyRegressor, make_trainer
from hf_helpers import VOCAB, tiny_llama

EXAMPLES, BATCH, SEQ = 32, 8, 6
PASSES: list[tuple[int, int]] = []  # per micro-batch of the current fit: (real passes, stand-in passes)


def recording(physical_batches):
    def run(adapter, batch, to_device=None):
        passes = physical_batches(adapter, batch, to_device)
        stand_ins = sum(1 for _, _, stand_in in passes if stand_in)
        PASSES.append((len(passes) - stand_ins, stand_ins))
        return passes

    return run


dp_mixin.physical_batches = recording(dp_mixin.physical_batches)


class ShardedLlama(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_llama()  # seeded: the same initial model on every rank
        for module in self.model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        ids = torch.randint(1, VOCAB, (EXAMPLES, SEQ), generator=torch.Generator().manual_seed(1))
        self.data = TensorDataset(ids)
        self.batch_sizes: list[int] = []

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        if torch.is_grad_enabled():  # not the leave-half-out check's replays
            self.batch_sizes.append(len(ids))
        return token_cross_entropy(self.model(input_ids=ids).logits, ids, "mean", shift=True)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=BATCH)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class Regressor(TinyRegressor):
    def training_step(self, batch, batch_idx):
        if torch.is_grad_enabled():
            self.batch_sizes.append(len(batch[0]))
        return super().training_step(batch, batch_idx)


def gathered(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in module.named_parameters()
    }


def fit(name: str, strategy, module, **trainer_options) -> pl.Trainer:
    PASSES.clear()
    module.batch_sizes = []
    trainer = make_trainer(strategy, devices=2, max_steps=3, **trainer_options)
    trainer.fit(module)
    engine = trainer.strategy.privacy_engine
    RESULT[name] = {
        "params": gathered(module),
        "steps": engine.steps,
        "epsilon": engine.epsilon(),
        "batch_sizes": list(module.batch_sizes),
        "passes": list(PASSES),
    }
    print(f"[rank {trainer.global_rank}] {name}: passes {PASSES}", flush=True)
    return trainer


RESULT: dict = {}

if __name__ == "__main__":
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    sharded = dict(noise_multiplier=1.0, max_grad_norm=0.5, seed=7)
    fit("sharded", DPModelParallelStrategy(**sharded), ShardedLlama())
    fit("sharded, cap 3", DPModelParallelStrategy(max_physical_batch_size=3, **sharded), ShardedLlama())
    replicated = dict(noise_multiplier=0.0, max_grad_norm=0.5, seed=3)
    torch.manual_seed(0)
    fit("replicated", DPDDPStrategy(**replicated), Regressor(batch_size=4), accumulate_grad_batches=2)
    torch.manual_seed(0)
    trainer = fit(
        "replicated, cap 2",
        DPDDPStrategy(max_physical_batch_size=2, **replicated),
        Regressor(batch_size=4),
        accumulate_grad_batches=2,
    )
    RESULT["rank"], RESULT["world_size"] = trainer.global_rank, trainer.world_size
    torch.save(RESULT, out / f"rank{trainer.global_rank}.pt")
