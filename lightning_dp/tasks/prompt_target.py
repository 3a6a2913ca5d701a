"""Causal-LM prompt/target examples shared by the generation recipes and the E2E LoRA example: truncation, tokenised
dataset, collator.

The loss is on the target and EOS only (prompt labels ``-100``; Li et al. 2022, "Large language models can be strong
differentially private learners", Section 3). Truncation: the target is cut to ``max_target_length``, then the
prompt's body is cut from its end so that ``body + tail + target + EOS`` fits ``max_length``; the tail is never cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch.utils.data import Dataset
from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerBase

from lightning_dp.hf.losses import IGNORE_INDEX


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


def causal_lm_collator(
    tokenizer: PreTrainedTokenizerBase, padding: bool | str = True, max_length: int | None = None
) -> DataCollatorForSeq2Seq:
    """Pads a batch of :class:`PromptTargetDataset` items (right side; labels padded with ``-100``): to its longest
    item, or with ``padding="max_length"`` to ``max_length`` tokens."""
    return DataCollatorForSeq2Seq(tokenizer, padding=padding, max_length=max_length, label_pad_token_id=IGNORE_INDEX)
