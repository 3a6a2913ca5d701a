"""The models of bench/gpu.py, built from configs (no download), at their real sizes or as tiny configs (``toy``) that
take the same code paths: the same classes, dtypes, checkpointing and LoRA, the same inputs and per-sample losses.

- ``gpt2``: GPT-2 124M (``GPT2Config()``'s defaults: 12 layers, d=768, the 50257-token vocabulary with ``lm_head``
  tied to ``wte``), causal LM at T=1024, float32.
- ``llama-1b`` and ``llama-1b-lora``: Llama-3.2-1B's shape (hidden 2048, 16 layers, 32 heads, 8 KV heads, intermediate
  8192, the 128256-token vocabulary with tied embeddings), bfloat16 weights, causal LM at T=2048, with activation
  checkpointing (HF's, non-reentrant); full fine-tuning, and LoRA through peft (r=16 on the attention and MLP
  projections, the rest frozen).
- ``bert``: BERT-base (``BertConfig()``'s defaults) for sequence classification (2 labels) at T=128, float32.
- ``vit``: ViT-B/16 (``ViTConfig()``'s defaults: 224 px, patches of 16) for image classification (1000 labels),
  float32.

Per-sample losses: the mean token cross-entropy of each sequence (causal LMs), the cross-entropy of each example
(classifiers). Inputs are random, fixed by a seed; the text models get ``position_ids`` expanded to the batch (Opacus
needs them per example, and every variant gets the same inputs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: Inputs of one batch: the keyword arguments of the model's forward, plus ``labels`` for the loss (kept out of the
#: forward so that HF's own mean loss is not computed).
Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ModelSpec:
    """One model of the bench at one size."""

    name: str
    kind: str  #: ``causal-lm``, ``text-classifier`` or ``image-classifier``
    config: Any  #: the transformers config
    batch_size: int  #: the physical batch of the timed steps
    seq_len: int  #: tokens per example (text) or image side in pixels (vision)
    dtype: torch.dtype
    checkpointing: bool = False  #: HF activation checkpointing, non-reentrant
    lora: bool = False  #: peft LoRA (r=16) instead of full fine-tuning

    def describe(self) -> dict[str, Any]:
        """What a record states about the model: its shape, the batch and the training mode."""
        return {
            "kind": self.kind,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "dtype": str(self.dtype).removeprefix("torch."),
            "checkpointing": self.checkpointing,
            "lora": self.lora,
            "config": {key: getattr(self.config, key, None) for key in _CONFIG_KEYS},
        }


_CONFIG_KEYS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "tie_word_embeddings", "image_size", "patch_size", "num_labels",
)  # fmt: skip
MODELS = ("gpt2", "llama-1b", "llama-1b-lora", "bert", "vit")
SIZES = ("real", "toy")


def _llama_config(toy: bool) -> Any:
    import transformers

    if toy:
        shape = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "intermediate_size": 128, "vocab_size": 1000}  # fmt: skip
    else:
        shape = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "intermediate_size": 8192, "vocab_size": 128256}  # fmt: skip
    return transformers.LlamaConfig(**shape, tie_word_embeddings=True, max_position_embeddings=131072)


def model_spec(name: str, size: str) -> ModelSpec:
    """The spec of model ``name`` (:data:`MODELS`) at ``size`` (:data:`SIZES`)."""
    import transformers

    toy = size == "toy"
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: one of {SIZES}")
    small = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128}
    if name == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000) if toy else None
        return ModelSpec(name, "causal-lm", config or transformers.GPT2Config(), 2 if toy else 8,
                         16 if toy else 1024, torch.float32)  # fmt: skip
    if name in ("llama-1b", "llama-1b-lora"):
        return ModelSpec(name, "causal-lm", _llama_config(toy), 2 if toy else 4, 16 if toy else 2048,
                         torch.bfloat16, checkpointing=True, lora=name.endswith("-lora"))  # fmt: skip
    if name == "bert":
        config = transformers.BertConfig(**small, vocab_size=1000) if toy else transformers.BertConfig()
        config.num_labels = 2
        return ModelSpec(name, "text-classifier", config, 2 if toy else 64, 16 if toy else 128, torch.float32)
    if name == "vit":
        config = transformers.ViTConfig(**small, image_size=32, patch_size=8) if toy else transformers.ViTConfig()
        config.num_labels = 1000
        return ModelSpec(name, "image-classifier", config, 2 if toy else 64, config.image_size, torch.float32)
    raise ValueError(f"unknown model {name!r}: one of {MODELS}")


def build_model(spec: ModelSpec, device: torch.device) -> torch.nn.Module:
    """The model of ``spec`` on ``device`` (weights initialised there, seed 0), in training mode."""
    import transformers

    classes = {
        "causal-lm": transformers.AutoModelForCausalLM,
        "text-classifier": transformers.AutoModelForSequenceClassification,
        "image-classifier": transformers.AutoModelForImageClassification,
    }
    torch.manual_seed(0)
    with torch.device(device):
        model = classes[spec.kind].from_config(spec.config, dtype=spec.dtype)
    if spec.checkpointing:
        enable_checkpointing(model)
    if spec.lora:
        import peft

        lora = peft.LoraConfig(
            r=16, lora_alpha=32, lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        )  # fmt: skip
        model = peft.get_peft_model(model, lora)
    return model.train()


def enable_checkpointing(model: torch.nn.Module) -> None:
    """HF activation checkpointing of every decoder layer, non-reentrant (``torch.utils.checkpoint`` with
    ``use_reentrant=False``): ``activation_checkpointing_enable`` where transformers has it (5.x, where
    ``gradient_checkpointing_enable`` is its deprecated alias), else ``gradient_checkpointing_enable``."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def make_batch(spec: ModelSpec, device: torch.device, batch_size: int | None = None) -> Batch:
    """A fixed random batch of ``batch_size`` examples (default the spec's) for ``spec``'s model."""
    size = batch_size or spec.batch_size
    generator = torch.Generator().manual_seed(1)
    if spec.kind == "image-classifier":
        side = spec.config.image_size
        pixels = torch.randn(size, spec.config.num_channels, side, side, generator=generator)
        labels = torch.randint(0, spec.config.num_labels, (size,), generator=generator)
        return {"pixel_values": pixels.to(device, spec.dtype), "labels": labels.to(device)}
    ids = torch.randint(0, spec.config.vocab_size, (size, spec.seq_len), generator=generator).to(device)
    positions = torch.arange(spec.seq_len, device=device).repeat(size, 1)  # its own rows, as a collator gives them
    if spec.kind == "causal-lm":
        return {"input_ids": ids, "position_ids": positions, "labels": ids}
    labels = torch.randint(0, spec.config.num_labels, (size,), generator=generator).to(device)
    return {"input_ids": ids, "position_ids": positions, "token_type_ids": torch.zeros_like(ids), "labels": labels}


def loss_function(spec: ModelSpec, batch: Batch) -> Callable[[torch.nn.Module], torch.Tensor]:
    """``module -> [B]``: the per-sample losses of a forward of ``batch`` through ``module`` (the model, or a wrapper
    around it)."""
    from lightning_dp.hf.losses import token_cross_entropy

    inputs = {key: value for key, value in batch.items() if key != "labels"}
    labels = batch["labels"]

    def per_sample_loss(module: torch.nn.Module) -> torch.Tensor:
        logits = module(**inputs).logits
        if spec.kind == "causal-lm":
            return token_cross_entropy(logits, labels, "mean", shift=True)
        return torch.nn.functional.cross_entropy(logits.float(), labels, reduction="none")

    return per_sample_loss
