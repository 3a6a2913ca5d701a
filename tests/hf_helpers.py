"""Tiny HF models (built from configs, no downloads), token datasets and trainer helpers for the HF tests."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import transformers
from models.zoo import TINY_SWIN
from torch.utils.data import Dataset
from transformers import TrainerCallback, TrainingArguments

from lightning_dp.hf import DPTrainer, PrivacyArguments

VOCAB = 50


#: GPT-2's dropout probabilities at 0 (``tiny_gpt2(**NO_DROPOUT)``): runs compared across process layouts draw no
#: dropout masks from the global RNG.
NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def tiny_gpt2(**overrides: Any) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        **{
            **dict(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=16, bos_token_id=0, eos_token_id=0),
            **overrides,
        }
    )
    return transformers.GPT2LMHeadModel(config)


def tiny_llama(dtype: torch.dtype = torch.float32, layers: int = 1) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return transformers.LlamaForCausalLM(config).to(dtype)


def tiny_bert_classifier(num_labels: int = 2) -> transformers.BertForSequenceClassification:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
        num_labels=num_labels,
    )
    return transformers.BertForSequenceClassification(config)


def tiny_swin(**overrides: Any) -> transformers.SwinForImageClassification:
    """A Swin classifier on 16x16 images whose first stage folds 4 windows per image into the rows (dropout and drop
    path 0 unless ``overrides`` set them)."""
    return transformers.SwinForImageClassification(transformers.SwinConfig(**{**TINY_SWIN, **overrides}))


class TokenDataset(Dataset):
    """``n`` random token sequences of length ``t``; LM labels are the ids with the last ``pad`` positions -100,
    classification labels are ``ids[0] % 2`` (learnable)."""

    def __init__(self, n: int = 32, t: int = 8, task: str = "lm", pad: int = 2, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, t), generator=gen)
        self.task, self.pad = task, pad

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.ids[i]
        if self.task == "cls":
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids[0] % 2}
        labels = ids.clone()
        labels[len(ids) - self.pad :] = -100
        return {"input_ids": ids, "labels": labels}


def training_args(tmp_path: Any, **overrides: Any) -> TrainingArguments:
    defaults: dict[str, Any] = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=3,
        logging_steps=1,
        learning_rate=0.05,
        report_to="none",
        save_strategy="no",
        max_grad_norm=0.0,
        disable_tqdm=True,
        dataloader_pin_memory=False,
        use_cpu=True,
    )
    return TrainingArguments(**{**defaults, **overrides})


def make_trainer(model: torch.nn.Module, tmp_path: Any, dataset: Dataset | None = None, *, privacy=None, **overrides):
    privacy = privacy or PrivacyArguments(noise_multiplier=1.0, accountant="rdp", dp_seed=0)
    return DPTrainer(
        model=model,
        args=training_args(tmp_path, **overrides.pop("args", {})),
        train_dataset=dataset if dataset is not None else TokenDataset(),
        privacy_args=privacy,
        **overrides,
    )


class NoiseCounter(TrainerCallback):
    """Counts noise draws (``mechanism.sample`` calls) and the optimizer steps the Trainer takes."""

    def __init__(self, trainer: DPTrainer) -> None:
        self.trainer, self.draws, self.optimizer_steps = trainer, 0, 0

    def on_train_begin(self, args, state, control, **kwargs):
        mechanism = self.trainer.privacy_engine.mechanism
        sample = type(mechanism).sample

        def counting(like, generator):
            self.draws += 1
            return sample(mechanism, like, generator)

        mechanism.sample = counting

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.optimizer_steps += 1


class LogRecorder(TrainerCallback):
    """Records what ``on_log`` hands to loggers (as a TensorBoard/CSV/MLflow integration would see it)."""

    def __init__(self) -> None:
        self.logs: list[dict[str, float]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def trainable_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def lora_llama(dtype: torch.dtype = torch.float32):
    """:func:`tiny_llama` with LoRA adapters (r = 4) on ``q_proj`` and ``v_proj`` (a ``peft.PeftModel``)."""
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(tiny_llama(dtype), config)


#: the steps of a run of ``scripts/hf_fault_script.py``.
FAULT_MAX_STEPS = 6


def checksum(model: torch.nn.Module) -> str:
    """sha256 of the parameters (names and bytes, in name order)."""
    digest = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()
