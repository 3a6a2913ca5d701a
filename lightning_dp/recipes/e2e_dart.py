"""E2E / DART table-to-text generation with a causal LM: the generation task of Li et al. 2022 ("Large language
models can be strong differentially private learners", section 3 and appendix).

``task: e2e`` (Novikova et al. 2017) or ``task: dart`` (Nan et al. 2021); ``data_source: local`` (``e2e/``, ``dart/``
under the data root, :data:`LOCAL_FILES`) or ``hub`` (``tuetschek/e2e_nlg``, ``Yale-LILY/dart`` at
``refs/convert/parquet``). A training example is one (table, reference) pair, an evaluation example one table with all
its references. The linearised table is followed by ``separator`` and the model is trained on ``" " + reference`` and
EOS (the loss on those tokens only); truncation: :mod:`~lightning_dp.tasks.prompt_target`. Decoding: beam search (5
beams, up to 100 new tokens), the hypothesis cut at its first newline. Metric: BLEU, ROUGE-1/2/L, METEOR in percent.
Formatting details, data files, commands and results: docs/recipes/e2e_dart.md.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import (
    PreTrainedTokenizerBase,
)

from lightning_dp.recipes import generation, metrics
from lightning_dp.recipes.run import parse_recipe
from lightning_dp.tasks.local_data import local_data_dir, require_file
from lightning_dp.tasks.prompt_target import PromptTarget
from lightning_dp.utils.naming import did_you_mean

TASKS = ("e2e", "dart")
#: The Hub datasets (their current ids; ``e2e_nlg`` and ``dart`` redirect to them).
HUB_DATASETS = {"e2e": "tuetschek/e2e_nlg", "dart": "Yale-LILY/dart"}
#: The configuration reading the same tasks from the Hub (named when local data is missing).
HUB_CONFIG = "configs/e2e_dart_hub.yaml"
#: Local copies: the (training, evaluation) files of the task's folder under the data root.
LOCAL_FILES = {
    "e2e": ("devset.csv", "testset_w_refs.csv"),
    "dart": ("dart-v1.1.1-full-dev.json", "dart-v1.1.1-full-test.from_xml.json"),
}
#: E2E attribute names as prefix-tuning's and Li et al.'s data files write them; the others are kept.
E2E_KEYS = {"eatType": "Type", "priceRange": "price", "familyFriendly": "family friendly"}
_MR_ITEM = re.compile(r"\s*([^\[\],][^\[\]]*?)\s*\[([^\]]*)\]\s*(?:,|$)")


@dataclass
class E2EDartArguments(generation.CausalLMArguments):
    """The E2E/DART recipe's arguments (common ones: :class:`~lightning_dp.recipes.generation.CausalLMArguments`).

    Attributes:
        separator: text between the table and the reference; ``{bos}`` stands for the tokenizer's BOS token
            (Li et al.: ``" {bos}"``).
        dataset_name: the Hub dataset id (default: :data:`HUB_DATASETS` of the task).
        dataset_revision: its revision (default ``refs/convert/parquet``, the Hub's parquet conversion).
    """

    task: str = field(default="e2e", metadata={"help": "e2e or dart."})
    model_name_or_path: str = field(default="gpt2", metadata={"help": "Causal LM: Hub id, folder, or package:NAME."})
    max_length: int = field(default=100, metadata={"help": "Tokens per example (table cut from its end)."})
    separator: str = field(default=" {bos}", metadata={"help": "Text between table and reference; {bos}: BOS token."})
    num_beams: int = field(default=5, metadata={"help": "Beams of the evaluation decoding (1: greedy)."})
    max_new_tokens: int = field(default=100, metadata={"help": "Tokens generated per evaluation table."})
    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset id (default per task)."})
    dataset_revision: str | None = field(
        default="refs/convert/parquet", metadata={"help": "Hub revision (default: the parquet conversion)."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}: choose e2e or dart{did_you_mean(self.task, TASKS)}")


def linearise_e2e(meaning_representation: str) -> str:
    """``"name[Blue Spice], eatType[coffee shop]"`` -> ``"name : Blue Spice | Type : coffee shop"`` (the attribute
    names of :data:`E2E_KEYS` renamed as in Li et al.'s data).

    Raises:
        ValueError: the text is not a list of ``attribute[value]`` items.
    """
    items = _MR_ITEM.findall(meaning_representation)
    if not items or "".join(_MR_ITEM.sub("", meaning_representation).split()):
        raise ValueError(f"not an E2E meaning representation (attribute[value], ...): {meaning_representation!r}")
    return " | ".join(f"{E2E_KEYS.get(key, key)} : {value}" for key, value in items)


def linearise_triples(tripleset: Sequence[Sequence[str]]) -> str:
    """``[[s, p, o], ...]`` -> ``"s : p : o | ..."`` with lower-cased predicates (Li et al.'s DART format).

    Raises:
        ValueError: an empty set or a triple without three parts.
    """
    if not tripleset or any(len(triple) != 3 for triple in tripleset):
        raise ValueError(f"a DART tripleset is a non-empty list of [subject, predicate, object], got {tripleset!r}")
    return " | ".join(f"{s} : {p.lower()} : {o}" for s, p, o in tripleset)


def group_references(pairs: Iterable[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """``(table, reference)`` pairs -> ``(table, [its references])`` in order of each table's first appearance."""
    grouped: dict[str, list[str]] = {}
    for table, reference in pairs:
        grouped.setdefault(table, []).append(reference)
    return list(grouped.items())


def make_examples(
    tables: Sequence[tuple[str, Sequence[str]]], separator: str, train: bool, limit: int | None
) -> list[PromptTarget]:
    """PromptTargets of linearised ``tables`` with their references: for training one per (table, reference) pair,
    the first ``limit`` pairs; for evaluation one per table holding all its references, the first ``limit`` tables.
    The target is the first reference (the one trained on), with a leading space as in Li et al."""
    if train:
        pairs = [(table, ref) for table, refs in tables for ref in refs][:limit]
        return [PromptTarget(table, separator, " " + ref.strip(), (ref,)) for table, ref in pairs]
    return [PromptTarget(table, separator, " " + refs[0].strip(), tuple(refs)) for table, refs in tables[:limit]]


def read_local(task: str, folder: Path) -> tuple[list[tuple[str, list[str]]], list[tuple[str, list[str]]]]:
    """The (training, evaluation) tables of the local copy in ``folder``: linearised tables, each with its
    references (training tables keep their rows' order; several rows of one E2E table stay separate pairs)."""
    train_file, eval_file = (require_file(folder / name) for name in LOCAL_FILES[task])
    if task == "e2e":
        return _e2e_tables(_read_csv(train_file), train=True), _e2e_tables(_read_csv(eval_file), train=False)
    return _dart_tables(_read_json(train_file)), _dart_tables(_read_json(eval_file))


def _read_csv(path: Path) -> list[tuple[str, str]]:
    with path.open(newline="", encoding="utf-8") as handle:
        return [(row["mr"], row["ref"]) for row in csv.DictReader(handle)]


def _read_json(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text(encoding="utf-8"))


def _e2e_tables(rows: Iterable[tuple[str, str]], train: bool) -> list[tuple[str, list[str]]]:
    """E2E rows ``(mr, ref)`` -> tables: one per row for training, grouped by meaning representation otherwise."""
    pairs = [(linearise_e2e(mr), ref) for mr, ref in rows]
    return [(table, [ref]) for table, ref in pairs] if train else group_references(pairs)


def _dart_tables(entries: Iterable[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """DART entries -> (linearised tripleset, its annotation texts); ``annotations`` is a list of
    ``{"source", "text"}`` (the JSON files) or ``{"source": [...], "text": [...]}`` (the Hub's columns)."""
    tables = []
    for entry in entries:
        annotations = entry["annotations"]
        texts = annotations["text"] if isinstance(annotations, dict) else [a["text"] for a in annotations]
        if texts:
            tables.append((linearise_triples(entry["tripleset"]), list(texts)))
    return tables


def read_hub(recipe: E2EDartArguments) -> tuple[list[tuple[str, list[str]]], list[tuple[str, list[str]]]]:
    """The (training, evaluation) tables of the Hub dataset's ``train`` and ``test`` splits."""
    from datasets import load_dataset

    data = load_dataset(recipe.dataset_name or HUB_DATASETS[recipe.task], revision=recipe.dataset_revision)
    if recipe.task == "e2e":

        def rows(split: str) -> list[tuple[str, str]]:
            return list(zip(data[split]["meaning_representation"], data[split]["human_reference"], strict=True))

        return _e2e_tables(rows("train"), train=True), _e2e_tables(rows("test"), train=False)
    return _dart_tables(data["train"]), _dart_tables(data["test"])


def separator_text(separator: str, tokenizer: PreTrainedTokenizerBase) -> str:
    """``separator`` with ``{bos}`` replaced by the tokenizer's BOS token (its EOS token when it has none)."""
    return separator.replace("{bos}", tokenizer.bos_token or tokenizer.eos_token)


def main(argv: list[str] | None = None) -> dict:
    """Parse ``--config FILE.yaml`` and flags (seeding every generator, :func:`~lightning_dp.recipes.run.parse_recipe`),
    fine-tune, decode, score, write ``results.json``; return the summary."""
    recipe, training, privacy = parse_recipe(E2EDartArguments, argv, description=__doc__.split("\n")[0])
    if recipe.data_source == "local":
        folder = local_data_dir(recipe.data_dir, recipe.task, LOCAL_FILES[recipe.task], HUB_CONFIG)
        train_tables, eval_tables = read_local(recipe.task, folder)
    else:
        train_tables, eval_tables = read_hub(recipe)
    with training.main_process_first(desc="model loading"):  # a packaged model is converted by one process
        model, tokenizer = generation.load_causal_lm_recipe(recipe)
    separator = separator_text(recipe.separator, tokenizer)
    train = make_examples(train_tables, separator, train=True, limit=recipe.train_size)
    evaluation = make_examples(eval_tables, separator, train=False, limit=recipe.eval_size)
    details = {"eval_tables": len(evaluation), "eval_references": sum(len(e.references) for e in evaluation)}
    return generation.run_generation_recipe(
        recipe,
        training,
        privacy,
        model=model,
        tokenizer=tokenizer,
        train=train,
        evaluation=evaluation,
        score=metrics.generation_metrics,
        details=details,
        postprocess=generation.first_line,  # one hypothesis per line, as in Li et al.'s evaluation files
    )
