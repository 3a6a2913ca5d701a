"""DPTrainer on several processes, started by ``tests/adapters/test_hf_distributed.py`` with ``accelerate launch``.

Usage: ``accelerate launch --multi_gpu --num_processes 2 hf_ddp_script.py OUT_DIR [--banded B | --blt D]``. Each rank
trains a tiny GPT-2 for 3 steps (per-device batch 4, 2 micro-batches, N = 32, a fixed noise multiplier and seed),
after perturbing the parameters of ranks other than 0 (so the initial broadcast is exercised), and writes
``OUT_DIR/rank{r}.json``: a checksum of its parameters before and after training, its privacy state (ledger), epsilon
and sample rate, and whether the Trainer left the model unwrapped (no ``DistributedDataParallel``). ``--banded B``:
``noise_correlation='banded'`` with ``correlation_band=B`` (``BANDED_OPTIONS``, q = 1 / B, so ``q_b = 1``) for 4
steps, without dropout (``--blt D``: ``noise_correlation='blt'`` with ``correlation_buffers=D`` at q = 1/2, so
b = 2 groups, likewise); the rank also writes its sampler's partition (``groups``), the dataset indices of each
micro-batch it yielded (``micro_batches``) and its parameters (``params``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch
from accelerate import PartialState

from lightning_dp.data.cyclic_poisson import CyclicPoissonBatchSampler
from lightning_dp.hf import PrivacyArguments
from lightning_dp.optim import distributed_context

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers

from hf_helpers import NO_DROPOUT, TokenDataset, make_trainer, tiny_gpt2

#: ``--banded B`` adds these privacy options (with ``correlation_band=B`` and ``sample_rate=1 / B``).
BANDED_OPTIONS = dict(noise_multiplier=1.0, noise_correlation="banded", dp_seed=0, check_batch_independence=False)


def checksum(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


class MicroBatchRecorder:
    """Records the dataset indices of every micro-batch the cyclic sampler yields, and the sampler (for its groups)."""

    def __init__(self) -> None:
        self.micro_batches: list[list[int]] = []
        self.sampler: CyclicPoissonBatchSampler | None = None
        original = CyclicPoissonBatchSampler.__iter__
        recorder = self

        def recording(sampler: CyclicPoissonBatchSampler):
            recorder.sampler = sampler
            for batch in original(sampler):
                recorder.micro_batches.append([int(i) for i in batch])
                yield batch

        CyclicPoissonBatchSampler.__iter__ = recording  # type: ignore[method-assign]


def main(out: Path, band: int | None, buffers: int | None) -> None:
    PartialState()  # initialises torch.distributed (gloo on CPU) from the launcher's environment
    context = distributed_context()
    assert context is not None, "torch.distributed was not initialised by the launcher"
    correlated = band is not None or buffers is not None
    model = tiny_gpt2(**NO_DROPOUT) if correlated else tiny_gpt2()  # compared with one process: no dropout
    with torch.no_grad():
        for p in model.parameters():
            p.add_(float(context.rank))  # ranks start apart: the broadcast of rank 0's parameters must fix this
    rank_zero_start = checksum(model) if context.rank == 0 else None
    recorder = MicroBatchRecorder() if correlated else None
    options: dict = dict(gradient_accumulation_steps=2, max_steps=3)
    privacy = None
    if band is not None:
        privacy = PrivacyArguments(**BANDED_OPTIONS, correlation_band=band, sample_rate=1 / band)
    if buffers is not None:
        blt = {**BANDED_OPTIONS, "noise_correlation": "blt"}
        privacy = PrivacyArguments(**blt, correlation_buffers=buffers, sample_rate=0.5)
    if correlated:
        options["max_steps"] = 4
    trainer = make_trainer(model, out / "trainer", TokenDataset(n=32), privacy=privacy, args=options)
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
    if recorder is not None:
        assert recorder.sampler is not None, "the cyclic sampler was not used"
        result["groups"] = recorder.sampler.groups.tolist()
        result["micro_batches"] = recorder.micro_batches
        result["params"] = [p.detach().flatten().tolist() for p in model.parameters()]
    (out / f"rank{context.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--banded", type=int, default=None)
    parser.add_argument("--blt", type=int, default=None)
    args = parser.parse_args()
    main(args.out, args.banded, args.blt)
