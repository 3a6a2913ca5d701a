"""DPTrainer on several processes, started by ``tests/adapters/test_hf_distributed.py`` with ``accelerate launch``.

Usage: ``accelerate launch --multi_gpu --num_processes 2 hf_ddp_script.py OUT_DIR``. Each rank trains a tiny GPT-2
for 3 steps (per-device batch 4, 2 micro-batches, N = 32, a fixed noise multiplier and seed), after perturbing the
parameters of ranks other than 0 (so the initial broadcast is exercised), and writes ``OUT_DIR/rank{r}.json``: a
checksum of its parameters before and after training, its privacy state (ledger), epsilon and sample rate, and
whether the Trainer left the model unwrapped (no ``DistributedDataParallel``).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch
from accelerate import PartialState

from lightning_dp.optim import distributed_context

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers

from hf_helpers import TokenDataset, make_trainer, tiny_gpt2


def checksum(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def main(out: Path) -> None:
    PartialState()  # initialises torch.distributed (gloo on CPU) from the launcher's environment
    context = distributed_context()
    assert context is not None, "torch.distributed was not initialised by the launcher"
    model = tiny_gpt2()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(float(context.rank))  # ranks start apart: the broadcast of rank 0's parameters must fix this
    rank_zero_start = checksum(model) if context.rank == 0 else None
    trainer = make_trainer(
        model, out / "trainer", TokenDataset(n=32), args=dict(gradient_accumulation_steps=2, max_steps=3)
    )
    trainer.train()
    engine = trainer.privacy_engine
    result = {
        "rank": context.rank,
        "world_size": context.world_size,
        "start": rank_zero_start,
        "end": checksum(model),
        "state": engine.state_dict(),
        "epsilon": engine.epsilon(),
        "sample_rate": engine.sample_rate,
        "steps": engine.steps,
        "accelerate_distributed_type": str(trainer.accelerator.distributed_type),
        "model_unwrapped": trainer.model_wrapped is model,
    }
    (out / f"rank{context.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
