"""Run by tests/adapters/test_fsdp_lightning.py: ``python fsdp_fit_script.py OUT_DIR`` trains a tiny Llama sharded with
``fully_shard`` in ``configure_model`` under DPModelParallelStrategy on 2 CPU processes (gloo), through Lightning's
own launcher. In one launch, every rank runs in turn:

- ``"a"`` and ``"b"``: ``DPModelParallelStrategy(seed=7)``, 3 steps (the same seed twice: determinism); after
  ``"a"``, the full weights gathered into an unsharded model on rank 0 and ``generate`` there, and ``generate`` on
  the sharded model on both ranks;
- ``"part"``: the same, 2 steps, with a ``ModelCheckpoint`` (sharded, DCP) at step 2; ``"resumed"``: from it to 3
  steps; ``"part (one file)"`` and ``"resumed (one file)"``: the same with ``save_distributed_checkpoint=False``
  (the full state in one file, saved with ``trainer.save_checkpoint`` after the fit);
- ``"missing weight"``: a fit from the one-file checkpoint without a trainable weight, ``strict_loading=False``
  (:func:`missing_weight_refused`);
- ``"refused"``: a fit from ``"part"``'s checkpoint stripped of its privacy state, then one without a checkpoint (both
  refused), then from the intact checkpoint twice, the second time into the module the first trained, on one trainer
  (:func:`refused_then_resumed`);
- ``"name"``: ``Trainer(strategy="dp_fsdp")``, 3 steps (epsilon 3, calibrated noise);
- ``"layers only"``: only the decoder layers sharded (the embedding and the final norm stay plain tensors, their
  clipped sums all-reduced), and rank 1's final norm weight changed before the strategy's setup;
- ``"lowpass part"`` and ``"lowpass resumed"``: a low-pass filter, 2 steps with a checkpoint, then resumed to 3;
- ``"momentum sharded"`` and ``"momentum replicated"``: per-sample momentum (``momentum_length=3``), zero noise, a
  float64 model, an evaluation forward after every step; sharded under DPModelParallelStrategy, unsharded under
  DPDDPStrategy on the same processes;
- ``"momentum part"`` and ``"momentum resumed"``: the same options with noise, sharded, 2 steps with a checkpoint,
  then resumed to 3.

Each rank writes ``OUT_DIR/rank{r}.pt``: per run the gathered parameters (``p.full_tensor()``) at the end and when
training starts (after a checkpoint is restored), the initial ones (before sharding), the engine's epsilon, steps,
sample rate, delta and noise multiplier, the callback's summary, the batch sizes the rank trained on; and the
logits of a prompt and the tokens generated from it (the gathered full state dict on rank 0).

Data: 64 sequences, per-rank ``batch_size`` 16, so q = 16 x 2 / 64 = 0.5: each rank's shard has 32 examples and a
rank's Poisson batch is empty with probability 2^-32 per step (the runs print their batch sizes, checked non-empty).
"""

import argparse
import logging
import shutil
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_dp import DPDDPStrategy, DPModelParallelStrategy, PrivacyAccountantCallback
from lightning_dp.hf.losses import token_cross_entropy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers

VOCAB, SEQ, EXAMPLES, BATCH = 1001, 8, 64, 16
STRATEGY = dict(noise_multiplier=1.0, max_grad_norm=0.5, clipping="mixed", seed=7)
PROMPT = torch.tensor([[5, 17, 256, 999]])
NEW_TOKENS = 6


def llama_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32, attn_implementation="eager",
    )  # fmt: skip


def gathered(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full parameters (``full_tensor()`` of the sharded ones: a collective)."""
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in module.named_parameters()
    }


class TinyLlama(pl.LightningModule):
    """A LlamaForCausalLM (tied embeddings, float32 unless ``dtype`` says otherwise), sharded on each decoder layer
    and on the root; with ``shard="layers"`` on the decoder layers only, and rank 1 starts with another final norm
    weight (the strategy copies rank 0's unsharded parameters); with ``shard="none"`` not at all (DPDDPStrategy)."""

    def __init__(self, shard: str = "layers and root", dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.shard, self.sharded = shard, False
        torch.manual_seed(0)  # every rank builds the same initial model
        self.model = LlamaForCausalLM(llama_config()).to(dtype)
        self.data = TensorDataset(torch.randint(0, VOCAB, (EXAMPLES, SEQ), generator=torch.Generator().manual_seed(1)))
        self.batch_sizes: list[int] = []

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        self.norm_before_setup = None
        if self.shard == "none" or self.sharded:
            return
        self.sharded = True  # a second fit of the same module keeps its sharding (fully_shard applies once)
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.model.layers:
            fully_shard(layer, mesh=mesh)
        if self.shard == "layers and root":
            fully_shard(self.model, mesh=mesh)
            return
        if self.global_rank == 1:
            with torch.no_grad():
                self.model.model.norm.weight.add_(1.0)
        self.norm_before_setup = self.model.model.norm.weight.detach().clone()

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        if torch.is_grad_enabled():  # not the first step's leave-half-out check, which replays the step under no_grad
            self.batch_sizes.append(len(ids))
        return token_cross_entropy(self.model(input_ids=ids).logits, ids, "mean", shift=True)

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=BATCH)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


class StartParams(Callback):
    """The gathered parameters, and the low-pass filter's and per-sample momentum's state, when training starts
    (after a checkpoint was restored)."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.params = gathered(pl_module.model)
        self.lowpass, self.momentum = dp_states(trainer.strategy.privacy_engine)


class Evaluate(Callback):
    """A forward without gradients after every training step (every rank runs it; FSDP2 then keeps the root's weights
    gathered until the next backward)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with torch.no_grad():
            pl_module.model(input_ids=PROMPT)


def dp_states(engine) -> tuple[dict | None, dict | None]:
    """The low-pass filter's and per-sample momentum's state (gathered on a sharded model: a collective), None for
    one the run does not use."""
    lowpass = None if engine.lowpass is None else engine.lowpass.state_dict()
    return lowpass, engine.momentum.state_dict() if engine.momentum.enabled else None


def make_trainer(strategy, steps: int, callbacks=()) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        logger=False,
        enable_checkpointing=any(isinstance(callback, ModelCheckpoint) for callback in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=list(callbacks),
    )


def refused_then_resumed(intact: Path, stripped: Path) -> None:
    """``"refused"``: one trainer fits from ``stripped`` (a checkpoint of 2 steps without its privacy state, which
    ModelParallelStrategy loads the weights of before the privacy state is checked), then without a checkpoint, then
    from ``intact``, then from ``intact`` again into the module that fit trained (the load writes every sharded
    weight, ``engine.weight_loads``); the messages of the refusals, and the steps and epsilon of the last fit."""
    trainer, errors = make_trainer(DPModelParallelStrategy(**STRATEGY), 3), []
    for ckpt_path in (stripped, None):
        try:
            trainer.fit(TinyLlama(), ckpt_path=ckpt_path)
        except ValueError as error:
            errors.append(str(error))
    module = TinyLlama()
    for _ in range(2):
        trainer.fit(module, ckpt_path=intact)
    engine = trainer.strategy.privacy_engine
    RESULT["refused"] = {"errors": errors, "steps": engine.steps, "epsilon": engine.epsilon()}


def missing_weight_refused(full: Path, missing: Path, rank: int) -> None:
    """``"missing weight"``: a fit with ``strict_loading=False`` from ``full`` without the first decoder layer's
    ``o_proj`` weight, which Lightning's non-strict load of one file would fill with the module's own value: the
    refusal's message."""
    if rank == 0:
        saved = torch.load(full, weights_only=False)
        del saved["state_dict"]["model.model.layers.0.self_attn.o_proj.weight"]
        torch.save(saved, missing)
    torch.distributed.barrier()
    module = TinyLlama()
    module.strict_loading = False
    try:
        make_trainer(DPModelParallelStrategy(save_distributed_checkpoint=False, **STRATEGY), 3).fit(
            module, ckpt_path=str(missing)
        )
        RESULT["missing weight"] = "not refused"
    except ValueError as error:
        RESULT["missing weight"] = str(error)


def fit(
    strategy, steps: int, name: str, callbacks=(), ckpt_path=None, **module_options
) -> tuple[pl.Trainer, TinyLlama]:
    module = TinyLlama(**module_options)
    initial = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    accountant, start = PrivacyAccountantCallback(plot=False), StartParams()
    trainer = make_trainer(strategy, steps, callbacks=[accountant, start, *callbacks])
    trainer.fit(module, ckpt_path=ckpt_path)
    engine = trainer.strategy.privacy_engine
    lowpass, momentum = dp_states(engine)
    RESULT[name] = {
        "params": gathered(module.model),
        "initial": initial,
        "start params": start.params,
        "epsilon": engine.epsilon(),
        "steps": engine.steps,
        "global_step": trainer.global_step,
        "sample_rate": engine.sample_rate,
        "num_samples": engine.num_samples,
        "delta": engine.target_delta,
        "noise_multiplier": engine.mechanism.noise_multiplier,
        "summary": accountant.summary,
        "batch_sizes": module.batch_sizes,
        "strategy": type(trainer.strategy).__name__,
        "norm before setup": module.norm_before_setup,
        "start lowpass": start.lowpass,
        "lowpass": lowpass,
        "start momentum": start.momentum,
        "momentum": momentum,
    }
    print(f"[rank {trainer.global_rank}] {name}: batch sizes {module.batch_sizes}", flush=True)
    return trainer, module


def generate(trainer: pl.Trainer, module: TinyLlama) -> None:
    """The two ways DPModelParallelStrategy's docstring gives: the full state dict on rank 0 loaded into an
    unsharded model, and the sharded model on every rank (``synced_gpus=True``); a fixed number of new tokens, so
    that both give the same length."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    full = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if trainer.global_rank == 0:
        plain = LlamaForCausalLM(llama_config()).float()
        plain.load_state_dict(full)
        plain.eval()
        RESULT["full state dict"] = {k: v.clone() for k, v in full.items()}
        with torch.no_grad():
            RESULT["logits on rank 0"] = plain(input_ids=PROMPT).logits
            RESULT["generated on rank 0"] = plain.generate(PROMPT, **options)
    else:
        RESULT["full state dict"] = full  # empty: only rank 0 receives the tensors
    module.model.eval()
    with torch.no_grad():
        RESULT["logits sharded"] = module.model(input_ids=PROMPT).logits
        RESULT["generated sharded"] = module.model.generate(PROMPT, synced_gpus=True, **options)


RESULT: dict = {}

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("lightning_dp %(levelname)s: %(message)s"))
    logging.getLogger("lightning_dp").addHandler(handler)
    logging.getLogger("lightning_dp").setLevel(logging.INFO)
    torch.set_num_threads(1)

    trainer, module = fit(DPModelParallelStrategy(**STRATEGY), 3, "a")
    generate(trainer, module)
    fit(DPModelParallelStrategy(**STRATEGY), 3, "b")
    checkpoint = ModelCheckpoint(dirpath=args.out / "ckpt", every_n_train_steps=2, save_top_k=-1)
    fit(DPModelParallelStrategy(**STRATEGY), 2, "part", callbacks=[checkpoint])
    (saved,) = sorted((args.out / "ckpt").iterdir())
    RESULT["checkpoint"] = {"path": str(saved), "files": sorted(p.name for p in saved.iterdir())}
    if trainer.global_rank == 0:
        RESULT["checkpoint"]["meta"] = torch.load(saved / "meta.pt", weights_only=False)
    fit(DPModelParallelStrategy(**STRATEGY), 3, "resumed", ckpt_path=str(saved))
    if trainer.global_rank == 0:
        shutil.copytree(saved, args.out / "stripped")
        meta = torch.load(saved / "meta.pt", weights_only=False)
        del meta["lightning_dp"]
        torch.save(meta, args.out / "stripped" / "meta.pt")
    torch.distributed.barrier()
    refused_then_resumed(saved, args.out / "stripped")
    full_file = DPModelParallelStrategy(save_distributed_checkpoint=False, **STRATEGY)
    trainer_full, _ = fit(full_file, 2, "part (one file)")
    trainer_full.save_checkpoint(args.out / "full.ckpt")  # after fit: one file, written by rank 0
    fit(DPModelParallelStrategy(save_distributed_checkpoint=False, **STRATEGY), 3, "resumed (one file)",
        ckpt_path=str(args.out / "full.ckpt"))  # fmt: skip
    RESULT["one file"] = (args.out / "full.ckpt").is_file()
    missing_weight_refused(args.out / "full.ckpt", args.out / "missing.ckpt", trainer.global_rank)
    fit("dp_fsdp", 3, "name")
    fit(DPModelParallelStrategy(**STRATEGY), 3, "layers only", shard="layers")
    lowpass = dict(STRATEGY, lowpass={"a": [-0.5], "b": [0.3, 0.2]})  # feedback and feed-forward history
    checkpoint = ModelCheckpoint(dirpath=args.out / "ckpt_lowpass", every_n_train_steps=2, save_top_k=-1)
    fit(DPModelParallelStrategy(**lowpass), 2, "lowpass part", callbacks=[checkpoint])
    (saved,) = sorted((args.out / "ckpt_lowpass").iterdir())
    fit(DPModelParallelStrategy(**lowpass), 3, "lowpass resumed", ckpt_path=str(saved))
    momentum = dict(STRATEGY, momentum_length=3, momentum_beta=0.8)
    exact = dict(momentum, noise_multiplier=0.0)
    fit(DPModelParallelStrategy(**exact), 3, "momentum sharded", callbacks=[Evaluate()], dtype=torch.float64)
    fit(DPDDPStrategy(**exact), 3, "momentum replicated", callbacks=[Evaluate()], dtype=torch.float64, shard="none")
    checkpoint = ModelCheckpoint(dirpath=args.out / "ckpt_momentum", every_n_train_steps=2, save_top_k=-1)
    fit(DPModelParallelStrategy(**momentum), 2, "momentum part", callbacks=[checkpoint])
    (saved,) = sorted((args.out / "ckpt_momentum").iterdir())
    fit(DPModelParallelStrategy(**momentum), 3, "momentum resumed", ckpt_path=str(saved))
    RESULT["rank"], RESULT["world_size"] = trainer.global_rank, trainer.world_size
    torch.save(RESULT, args.out / f"rank{trainer.global_rank}.pt")
