"""DPTrainer under accelerate's FSDP2 configuration, 2 processes, started by
``tests/adapters/test_hf_accelerate_fsdp.py``.

Usage: ``accelerate launch --config_file configs/accelerate/fsdp2_2_processes.yaml hf_accelerate_fsdp_script.py
OUT_DIR``. The config asks for FSDP2 with the transformer-block wrap policy. A tiny float64 Llama with two blocks
and tied embeddings is saved once, then loaded by every rank and handed UNSHARDED to ``DPTrainer``, which shards it.
Runs (zero noise unless said, 3 steps, per-device batch 4, 2 micro-batches, N = 32):

- ``"sharded"``: full fine-tuning; ``"replicated"``: the same with the launcher's FSDP request removed from the
  environment (the model then loads whole on every rank and trains unsharded): the parameters must agree;
- ``"lora sharded"`` / ``"lora replicated"``: the same with LoRA adapters (peft) on the attention projections;
- ``"noisy"``: Gaussian noise, sharded, for epsilon and its logs;
- ``"meta"``: as ``"sharded"``, with rank 1's loaded model moved to the ``meta`` device first, as transformers
  versions that load on rank 0 only leave it (transformers 5.23 loads on every rank): DPTrainer fills it from rank 0.

Each rank writes ``OUT_DIR/rank{r}.pt``: per run whether the model was sharded (and which modules ``fully_shard``
went to), whether the loaded weights were on ``meta`` before DPTrainer, the gathered parameters before and after
training, epsilon, the logged epsilons and the bytes of the local parameter shards.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import peft
import torch
import transformers
from accelerate import PartialState
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_dp.hf import PrivacyArguments
from lightning_dp.hf.accelerate_fsdp import hidden_from_accelerate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers

from hf_helpers import LogRecorder, TokenDataset, make_trainer, tiny_llama

N, BATCH, ACCUM, STEPS = 32, 4, 2, 3
RESULT: dict = {}


def save_tiny_llama(folder: Path) -> None:
    tiny_llama(torch.float64, layers=2).save_pretrained(folder)


def load(folder: Path, lora: bool) -> torch.nn.Module:
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float64)
    if lora:
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
        torch.manual_seed(1)  # the adapters' initialisation (DPTrainer gives every rank rank 0's anyway)
        model = peft.get_peft_model(model, config)
    return model


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def train(
    name: str,
    folder: Path,
    out: Path,
    noise: float = 0.0,
    lora: bool = False,
    meta: bool = False,
    checkpointing: bool = False,
) -> None:
    model = load(folder, lora)
    if meta and torch.distributed.get_rank() != 0:
        model.to("meta")  # what cpu-RAM-efficient loading leaves on ranks other than 0 (tied weights stay tied)
    on_meta = any(p.is_meta for p in model.parameters())
    privacy = PrivacyArguments(noise_multiplier=noise, accountant="rdp", dp_seed=0, clipping="mixed")
    args = dict(per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM, max_steps=STEPS)
    if checkpointing:
        args["gradient_checkpointing"] = True  # HF's non-reentrant checkpointing of every block, inside FSDP2
    trainer = make_trainer(model, out / name, TokenDataset(n=N), privacy=privacy, args=args)
    recorder = LogRecorder()
    trainer.add_callback(recorder)
    before = gathered(model)
    trainer.train()
    engine = trainer.privacy_engine
    RESULT[name] = {
        "loaded on meta": on_meta,
        "sharded": any(isinstance(p, DTensor) for p in model.parameters()),
        "fsdp modules": sorted(type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule)),
        "fsdp enabled in accelerate": trainer.is_fsdp_enabled,
        "before": before,
        "params": gathered(model),
        "epsilon": engine.epsilon(),
        "sample_rate": engine.sample_rate,
        "delta": engine.target_delta,
        "steps": engine.steps,
        "logged epsilons": [log["epsilon"] for log in recorder.logs if "epsilon" in log],
        "local parameter bytes": sum(
            (p.to_local() if isinstance(p, DTensor) else p).untyped_storage().nbytes() for p in model.parameters()
        ),
    }


def main(out: Path) -> None:
    state = PartialState()  # initialises torch.distributed (gloo on CPU) from the launcher's environment
    torch.set_num_threads(1)
    folder = out / "tiny_llama"
    if state.is_main_process:
        save_tiny_llama(folder)
    torch.distributed.barrier()
    RESULT["environment"] = {k: v for k, v in os.environ.items() if k.startswith(("ACCELERATE_USE_FSDP", "FSDP_"))}
    train("sharded", folder, out)
    train("lora sharded", folder, out, lora=True)
    train("noisy", folder, out, noise=1.0)
    train("meta", folder, out, meta=True)
    train("checkpointed", folder, out, checkpointing=True)
    with hidden_from_accelerate():  # the same launch without the FSDP request: every rank loads and trains unsharded
        train("replicated", folder, out)
        train("lora replicated", folder, out, lora=True)
    RESULT["environment after"] = {
        k: v for k, v in os.environ.items() if k.startswith(("ACCELERATE_USE_FSDP", "FSDP_"))
    }
    RESULT["rank"], RESULT["world_size"] = state.process_index, state.num_processes
    torch.save(RESULT, out / f"rank{state.process_index}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
