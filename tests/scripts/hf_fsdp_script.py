"""DPTrainer on an FSDP2-sharded model, 2 processes, started by ``tests/adapters/test_hf_fsdp.py`` with ``accelerate
launch``.

Usage: ``accelerate launch --config_file configs/accelerate/ddp_2_processes.yaml hf_fsdp_script.py OUT_DIR``. The
tiny float64 Llama (tied embeddings) is sharded with ``fully_shard`` on each block and on the root before it is
handed to ``DPTrainer``, as a user does. Runs, each from the same initial model and data:

- ``"noisy"``: 3 steps (per-device batch 4, 2 micro-batches, N = 32), Gaussian noise, ``mixed`` clipping, a
  checkpoint at step 2; then ``save_model`` (the full weights, written by rank 0) and ``generate`` on the sharded
  model on every rank;
- ``"sharded"`` and ``"replicated"``: 3 steps with zero noise, the same model sharded and unsharded (the unsharded
  one trains as on several processes without sharding): the parameters must agree;
- ``"lora sharded"`` and ``"lora replicated"``: the same with LoRA adapters (peft) on the attention projections;
- ``"small batches"``: per-device batch 1, so some ranks' Poisson batches are empty and run the stand-in batch
  (counted); ``"small sharded"`` and ``"small replicated"``: the same with 2 micro-batches and zero noise, sharded
  and unsharded (the stand-in batches must add exactly nothing);
- ``"lora resumed"``: the ``"lora sharded"`` run resumed from its checkpoint at step 2;
- ``"best"``: evaluation and a checkpoint at every step, ``load_best_model_at_end=True``;
- ``"lowpass sharded"`` and ``"lowpass replicated"``: zero noise with a low-pass filter (DP-PMLF's), sharded and
  unsharded; ``"lowpass resumed"``: the sharded one resumed from its checkpoint at step 2 (the filter's history,
  gathered into the checkpoint, is taken back shard by shard);
- ``"resumed"``: the ``"noisy"`` run resumed from its checkpoint at step 2 (model and optimizer shards, privacy
  state), on a fresh sharded model;
- ``"momentum sharded"`` and ``"momentum replicated"``: zero noise with per-sample momentum (3 iterates), batch 1
  (empty Poisson batches: the sharded run's stand-in batches are re-run at the stored iterates), an evaluation and a
  checkpoint at every step, sharded and unsharded; ``"momentum resumed sharded"`` and ``"momentum resumed
  replicated"``: each resumed from its checkpoint at step 2 (the iterates, gathered into the checkpoint, taken back
  shard by shard);
- ``"correlated independent"``, ``"correlated banded"`` and ``"correlated blt"``: a loss with zero gradient (every
  update is pure noise), SGD at learning rate 1, q = 1/2, 4 steps, independent noise, banded noise (band 2) and BLT
  noise (2 buffers), each recording the gathered parameters after every step; ``"exact whole"``: the BLT run unseeded
  with ``exact_resume=True`` and a checkpoint at step 2, and ``"exact resumed"``: resumed from it (warm buffers) to
  step 4.

Every run records the gathered parameters and optimizer state (and the low-pass filter's and per-sample momentum's
state, when it has them) when it writes a checkpoint and when its training begins (after a resume restored them).

Each rank writes ``OUT_DIR/rank{r}.pt``: per run the gathered parameters, the privacy state, epsilon, the sample
rate and the logged epsilons; the logits of the saved model reloaded on rank 0 and of the sharded model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import peft
import torch
from accelerate import PartialState
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import LlamaForCausalLM, TrainerCallback
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from lightning_dp.hf import DPTrainer, PrivacyArguments
from lightning_dp.runtime.distributed import distributed_context

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers

from correlation_helpers import zero_gradient_run
from hf_helpers import LogRecorder, TokenDataset, make_trainer, tiny_llama, training_args

N, BATCH, ACCUM, STEPS = 32, 4, 2, 3
PROMPT = torch.tensor([[5, 17, 2, 31]])
#: a low-pass filter with both a feedback (``a``) and a feed-forward history (``b`` beyond ``b_0``)
LOWPASS = {"a": [-0.5], "b": [0.3, 0.2]}


def lora(model: torch.nn.Module) -> torch.nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(model, config)


def shard(model: torch.nn.Module) -> torch.nn.Module:
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.modules():
        if isinstance(layer, LlamaDecoderLayer):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


class Snapshot(TrainerCallback):
    """The gathered parameters and optimizer state (full, on rank 0) when a checkpoint is written and when training
    begins (after a resume restored them); every rank runs the callbacks, so the gathers are collectives."""

    def __init__(self, trainer) -> None:
        self.trainer, self.taken, self.lowpass, self.momentum = trainer, {}, {}, {}

    def take(self, when: str, model: torch.nn.Module) -> None:
        optimizer = self.trainer._dp_optimizer.original_optimizer
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        self.taken[when] = (gathered(model), get_optimizer_state_dict(model, optimizer, options=options))
        engine = self.trainer.privacy_engine  # the state_dicts below gather sharded tensors (collectives)
        if engine.lowpass is not None:
            self.lowpass[when] = engine.lowpass.state_dict()
        if engine.momentum.enabled:
            self.momentum[when] = engine.momentum.state_dict()

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.take("begin", model)

    def on_save(self, args, state, control, model=None, **kwargs):
        self.take(f"save {state.global_step}", model)


def train(
    name: str,
    model: torch.nn.Module,
    out: Path,
    noise: float,
    batch: int = BATCH,
    accum: int = ACCUM,
    resume: Path | None = None,
    privacy: dict | None = None,
    **args,
):
    """Train ``model`` with ``DPTrainer`` as run ``name`` (``privacy``: further privacy options, ``args``: further
    training arguments) and record what the tests read in ``RESULT[name]``."""
    privacy = PrivacyArguments(noise_multiplier=noise, accountant="rdp", dp_seed=0, clipping="mixed", **(privacy or {}))
    arguments = dict(per_device_train_batch_size=batch, gradient_accumulation_steps=accum, max_steps=STEPS)
    evaluation = {"eval_dataset": TokenDataset(n=8, seed=1)} if args.get("eval_strategy") else {}
    trainer = make_trainer(
        model, out / name, TokenDataset(n=N), privacy=privacy, args={**arguments, **args}, **evaluation
    )
    recorder, snapshot = LogRecorder(), Snapshot(trainer)
    trainer.add_callback(recorder)
    trainer.add_callback(snapshot)
    engine = trainer.privacy_engine
    stand_ins = []
    stand_in_batch = engine.stand_in_batch
    engine.stand_in_batch = lambda: stand_ins.append(1) or stand_in_batch()
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    optimizer = trainer._dp_optimizer.original_optimizer
    RESULT[name] = {
        "params": gathered(model),
        "state": engine.state_dict(),
        "epsilon": engine.epsilon(),
        "sample_rate": engine.sample_rate,
        "delta": engine.target_delta,
        "steps": engine.steps,
        "logged epsilons": [log["epsilon"] for log in recorder.logs if "epsilon" in log],
        "logged losses": [log["loss"] for log in recorder.logs if "loss" in log],
        "best step": trainer.state.best_global_step,
        "sharded": any(isinstance(p, DTensor) for p in model.parameters()),
        "stand-in batches": len(stand_ins),
        "snapshots": snapshot.taken,
        "lowpass snapshots": snapshot.lowpass,
        "momentum snapshots": snapshot.momentum,
        "local bytes": {  # what this rank holds of the parameters and of the optimizer's state
            "parameters": sum(_bytes(p) for p in model.parameters()),
            "optimizer state": sum(_bytes(v) for state in optimizer.state.values() for v in state.values() if v.ndim),
            "momentum iterates": sum(_bytes(value) for iterate in engine.momentum.history for value in iterate),
        },
    }
    return trainer


class ZeroGradientTrainer(DPTrainer):
    """DPTrainer whose per-example losses are 0 times the model's: the clipped sum is 0, each update pure noise."""

    def compute_per_example_loss(self, model, inputs):
        return super().compute_per_example_loss(model, inputs) * 0.0


class Iterates(TrainerCallback):
    """The gathered parameters, flattened, before training and after every step (gathers: collectives)."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []

    def take(self, model: torch.nn.Module) -> None:
        self.params.append(torch.cat([p.flatten() for p in gathered(model).values()]))

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.take(model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.take(model)


def train_correlated(name: str, out: Path, options: dict, *, resume: Path | None = None, **arguments) -> None:
    """Run ``name`` on a sharded model with zero gradients and the correlation ``options`` (seed 7 unless they say
    otherwise), resumed from ``resume`` if given, with further ``TrainingArguments``; record it in ``RESULT[name]``
    (``correlation_helpers.zero_gradient_run``)."""
    model = shard(tiny_llama(torch.float64))
    privacy = PrivacyArguments(noise_multiplier=0.8, per_sample_max_grad_norm=1.5, **{"dp_seed": 7, **options})
    sgd = dict(optim="sgd", learning_rate=1.0, lr_scheduler_type="constant", weight_decay=0.0, max_steps=4)
    batches = dict(per_device_train_batch_size=BATCH, gradient_accumulation_steps=ACCUM)
    args = training_args(out / name, **sgd, **batches, **arguments)
    trainer = ZeroGradientTrainer(model=model, args=args, train_dataset=TokenDataset(n=N), privacy_args=privacy)
    iterates = Iterates()
    trainer.add_callback(iterates)
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    RESULT[name] = zero_gradient_run(trainer.privacy_engine, iterates.params, model)


def _bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


RESULT: dict = {}


def main(out: Path) -> None:
    PartialState()  # initialises torch.distributed (gloo on CPU) from the launcher's environment
    torch.set_num_threads(1)
    context = distributed_context()
    assert context is not None, "torch.distributed was not initialised by the launcher"
    RESULT["initial"] = gathered(tiny_llama(torch.float64))

    model = shard(tiny_llama(torch.float64))
    trainer = train("noisy", model, out, noise=1.0, save_strategy="steps", save_steps=2)
    trainer.save_model(str(out / "saved"))  # every rank gathers, rank 0 writes
    model.eval()
    with torch.no_grad():
        RESULT["logits sharded"] = model(input_ids=PROMPT).logits
        RESULT["generated sharded"] = model.generate(
            PROMPT, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0, synced_gpus=True
        )
    if context.rank == 0:
        saved = LlamaForCausalLM.from_pretrained(out / "saved", torch_dtype=torch.float64).eval()
        with torch.no_grad():
            RESULT["logits saved"] = saved(input_ids=PROMPT).logits

    train("sharded", shard(tiny_llama(torch.float64)), out, noise=0.0)
    train("replicated", tiny_llama(torch.float64), out, noise=0.0)
    checkpoints = dict(save_strategy="steps", save_steps=2)
    train("lora sharded", shard(lora(tiny_llama(torch.float64))), out, noise=0.0, **checkpoints)
    train("lora replicated", lora(tiny_llama(torch.float64)), out, noise=0.0)
    lora_checkpoint = out / "lora sharded" / "checkpoint-2"
    train("lora resumed", shard(lora(tiny_llama(torch.float64))), out, 0.0, resume=lora_checkpoint, **checkpoints)
    train("small batches", shard(tiny_llama(torch.float64)), out, noise=1.0, batch=1, accum=1)
    lowpass = {"lowpass": LOWPASS}
    train("lowpass sharded", shard(tiny_llama(torch.float64)), out, 0.0, privacy=lowpass, **checkpoints)
    train("lowpass replicated", tiny_llama(torch.float64), out, 0.0, privacy=lowpass)
    lowpass_checkpoint = out / "lowpass sharded" / "checkpoint-2"
    resumed = shard(tiny_llama(torch.float64))
    train("lowpass resumed", resumed, out, 0.0, resume=lowpass_checkpoint, privacy=lowpass, **checkpoints)
    momentum = {"momentum_length": 3, "momentum_beta": 0.8}
    every_step = dict(batch=1, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1)
    for how, sharding in (("sharded", shard), ("replicated", lambda model: model)):
        train(f"momentum {how}", sharding(tiny_llama(torch.float64)), out, 0.0, privacy=momentum, **every_step)
        checkpoint = out / f"momentum {how}" / "checkpoint-2"
        model = sharding(tiny_llama(torch.float64))
        train(f"momentum resumed {how}", model, out, 0.0, resume=checkpoint, privacy=momentum, **every_step)
    train("small sharded", shard(tiny_llama(torch.float64)), out, noise=0.0, batch=1, accum=2)
    train("small replicated", tiny_llama(torch.float64), out, noise=0.0, batch=1, accum=2)
    best = dict(eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1, load_best_model_at_end=True)
    train("best", shard(tiny_llama(torch.float64)), out, noise=1.0, **best, metric_for_best_model="loss")
    resumed = shard(tiny_llama(torch.float64))
    train(
        "resumed", resumed, out, noise=1.0, resume=out / "noisy" / "checkpoint-2", save_strategy="steps", save_steps=2
    )
    train_correlated("correlated independent", out, {})
    train_correlated("correlated banded", out, {"noise_correlation": "banded", "correlation_band": 2})
    train_correlated("correlated blt", out, {"noise_correlation": "blt", "correlation_buffers": 2})
    exact = {"noise_correlation": "blt", "correlation_buffers": 2, "exact_resume": True, "dp_seed": None}
    saving = dict(save_strategy="steps", save_steps=2, ignore_data_skip=True)
    train_correlated("exact whole", out, exact, **saving)
    train_correlated("exact resumed", out, exact, resume=out / "exact whole" / "checkpoint-2", **saving)
    RESULT["rank"], RESULT["world_size"] = context.rank, context.world_size
    torch.save(RESULT, out / f"rank{context.rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
