"""DPTrainer with ``max_physical_batch_size`` on several processes, started by
``tests/adapters/test_physical_batch_cap_processes.py`` with ``accelerate launch`` (2 CPU processes, gloo).

Usage: ``accelerate launch --config_file configs/accelerate/ddp_2_processes.yaml hf_cap_script.py OUT_DIR``. Each rank
trains for 3 steps (per-device batch 4, 2 micro-batches, N = 32, seeded noise), without and with a cap of 1 example
per pass: a tiny GPT-2 (dropout off, replicated), and a tiny Llama sharded with ``fully_shard`` on each decoder layer
and the root (the ranks pad to the same pass count with stand-in batches). It writes ``OUT_DIR/rank{r}.pt``: per run
the (gathered) parameters, the steps and epsilon, and the sizes of the batches ``compute_per_example_loss`` ran on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from accelerate import PartialState
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lightning_dp.hf import DPTrainer, PrivacyArguments
from lightning_dp.optim import distributed_context

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers

from hf_helpers import TokenDataset, tiny_gpt2, tiny_llama, training_args


class SizeRecordingTrainer(DPTrainer):
    """Records the rows of every batch the per-example loss is computed on with gradients."""

    sizes: list[int]

    def compute_per_example_loss(self, model, inputs):
        if torch.is_grad_enabled():
            self.sizes.append(len(inputs["input_ids"]))
        return super().compute_per_example_loss(model, inputs)


def shard(model: torch.nn.Module) -> torch.nn.Module:
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def run(out: Path, cap: int | None, sharded: bool = False) -> dict:
    model = shard(tiny_llama()) if sharded else tiny_gpt2()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    privacy = PrivacyArguments(
        noise_multiplier=1.0, per_sample_max_grad_norm=0.1, accountant="rdp", dp_seed=0, max_physical_batch_size=cap
    )
    args = training_args(out / f"trainer{cap}{sharded}", gradient_accumulation_steps=2, max_steps=3)
    trainer = SizeRecordingTrainer(model=model, args=args, train_dataset=TokenDataset(n=32), privacy_args=privacy)
    trainer.sizes = []
    trainer.train()
    engine = trainer.privacy_engine
    return {
        "params": gathered(model),
        "steps": engine.steps,
        "epsilon": engine.epsilon(),
        "sizes": trainer.sizes,
    }


def main(out: Path) -> None:
    PartialState()  # initialises torch.distributed (gloo on CPU) from the launcher's environment
    context = distributed_context()
    assert context is not None, "torch.distributed was not initialised by the launcher"
    result = {"rank": context.rank, "world_size": context.world_size, "uncapped": run(out, None), "capped": run(out, 1)}
    result.update({"sharded": run(out, None, sharded=True), "sharded, capped": run(out, 1, sharded=True)})
    torch.save(result, out / f"rank{context.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
