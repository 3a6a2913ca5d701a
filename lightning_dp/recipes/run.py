"""What every recipe shares: its common arguments, where its local data lives, the seeding, the script's error
handling, and (HF recipes) the run itself (Trainer or DPTrainer, training, the task's evaluation, one
``results.json``).

All the differential privacy comes from :class:`~lightning_dp.hf.DPTrainer` and
:class:`~lightning_dp.hf.PrivacyArguments` (HF) or :class:`~lightning_dp.DPStrategy` (Lightning); a recipe adds
only data, model and metric.

Local data (the offline configurations) is found by :func:`~lightning_dp.tasks.local_data.local_data_dir`: the data
root ``--data_dir`` (or the dataset's own folder), else ``LIGHTNING_DP_DATA``.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from torch import nn
from torch.utils.data import Dataset
from transformers import PretrainedConfig, Trainer, TrainingArguments, set_seed

from lightning_dp.cli.args import USAGE_ERROR, guarded
from lightning_dp.engine.privacy_engine import PrivacyEngine
from lightning_dp.hf import DPTrainer, PrivacyArguments
from lightning_dp.recipes.config import parse_recipe_args
from lightning_dp.runtime.environment import run_environment
from lightning_dp.tasks.local_data import LocalDataError, local_data_dir
from lightning_dp.tasks.pretrained import DEFAULT_CACHE

log = logging.getLogger("lightning_dp")

#: Share of a single-file local copy used for training, in file order (the rest evaluates): see :func:`split_rows`.
LOCAL_TRAIN_FRACTION = Fraction(4, 5)


@dataclass
class RecipeArguments:
    """Arguments every HF recipe has (each recipe subclasses this with its own fields).

    Attributes:
        task: the recipe's task or subset (e.g. ``sst2`` for GLUE, ``e2e`` for E2E/DART); the recipe checks it.
        data_source: ``"local"`` (the offline copy under ``data_dir``) or ``"hub"`` (``datasets.load_dataset``).
        data_dir: the data root holding the dataset's folder (``glue/``, ``e2e/``, ...), or that folder itself;
            default ``$LIGHTNING_DP_DATA`` (see :func:`~lightning_dp.tasks.local_data.local_data_dir`).
        model_name_or_path: a Hub id, a folder, or ``package:NAME`` (see :mod:`lightning_dp.tasks.pretrained`).
        cache_dir: where converted packaged models are kept.
        tiny_model: a random model of the same architecture and tokenizer, tiny (smoke tests; metrics meaningless).
        train_size: use the first ``train_size`` training examples (``None``: all).
        eval_size: evaluate on the first ``eval_size`` evaluation examples (``None``: all).
        max_length: tokens per example; longer inputs are cut by the recipe's documented rule.
        pad_to_max_length: pad every batch to ``max_length`` (HF's name) instead of to its longest example: the
            float32 rounding of the per-example norms then does not move with which examples were sampled, which
            crafted examples can otherwise exploit (docs/privacy.md, "What is not covered"); slower where examples
            are shorter than ``max_length``.
        lora_rank: rank of peft LoRA adapters (0: fine-tune the model's own trainable parameters).
        lora_target_modules: module names that get adapters (e.g. ``q_proj v_proj``).
        lora_layers: adapt only the top ``lora_layers`` transformer layers (``None``: all).
        dp: train with DP (``DPTrainer``); ``false`` runs the same recipe through the plain ``Trainer``, as
            ``disable_dp: true`` (the privacy arguments' switch) does.
        results_file: where the run's JSON summary is written (default ``OUTPUT_DIR/results.json``).
    """

    task: str = field(default="", metadata={"help": "Task or subset of the recipe."})
    data_source: str = field(default="local", metadata={"help": "local (offline copy) or hub (datasets)."})
    data_dir: str | None = field(
        default=None,
        metadata={"help": "Data root holding glue/, e2e/, ... (or the dataset's folder); default $LIGHTNING_DP_DATA."},
    )
    model_name_or_path: str = field(default="", metadata={"help": "Hub id, folder, or package:NAME."})
    cache_dir: str = field(default=str(DEFAULT_CACHE), metadata={"help": "Cache of converted packaged models."})
    tiny_model: bool = field(default=False, metadata={"help": "Tiny random model (smoke tests)."})
    train_size: int | None = field(default=None, metadata={"help": "First N training examples (default all)."})
    eval_size: int | None = field(default=None, metadata={"help": "First N evaluation examples (default all)."})
    max_length: int = field(default=128, metadata={"help": "Tokens per example (longer inputs are cut)."})
    pad_to_max_length: bool = field(
        default=False, metadata={"help": "Pad every batch to max_length (default: to its longest example)."}
    )
    lora_rank: int = field(default=0, metadata={"help": "LoRA rank (0: no adapters)."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "v_proj"], metadata={"help": "Modules that get LoRA adapters."}
    )
    lora_layers: int | None = field(default=None, metadata={"help": "Adapt the top N layers only (default all)."})
    dp: bool = field(default=True, metadata={"help": "Train with DP (false: plain Trainer)."})
    results_file: str | None = field(default=None, metadata={"help": "JSON summary (default OUTPUT_DIR/results.json)."})

    @property
    def collator_padding(self) -> dict[str, Any]:
        """The padding arguments of the recipe's ``transformers`` data collator: to ``max_length`` with
        ``pad_to_max_length``, else none (the collator pads each batch to its longest example)."""
        return {"padding": "max_length", "max_length": self.max_length} if self.pad_to_max_length else {}

    def __post_init__(self) -> None:
        if self.data_source not in ("local", "hub"):
            raise ValueError(f"data_source must be 'local' or 'hub', got {self.data_source!r}")
        if not self.model_name_or_path:
            raise ValueError("model_name_or_path is required (a Hub id, a folder, or package:NAME)")
        for name in ("train_size", "eval_size"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive (or unset for all examples), got {value}")
        if self.max_length <= 0:
            raise ValueError(f"max_length must be positive, got {self.max_length}")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0: no LoRA), got {self.lora_rank}")


def split_in_file_order(rows: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """A single-file local copy cut into (training, evaluation) rows in file order: the first
    :data:`LOCAL_TRAIN_FRACTION` (rounded down) train, the rest evaluate.

    Raises:
        ValueError: fewer than 2 rows (one side would be empty).
    """
    cut = len(rows) * LOCAL_TRAIN_FRACTION.numerator // LOCAL_TRAIN_FRACTION.denominator
    if cut == 0 or cut == len(rows):
        raise ValueError(f"the local copy has {len(rows)} row(s): too few to split into training and evaluation rows")
    return list(rows[:cut]), list(rows[cut:])


def first_rows(split: Any, size: int | None) -> list[dict[str, Any]]:
    """The first ``size`` rows (all for ``None``) of a ``datasets.Dataset`` split, as dicts; only those rows are
    decoded."""
    if size is not None:
        split = split.select(range(min(size, len(split))))
    return list(split)


def split_rows(
    recipe: RecipeArguments,
    *,
    dataset: str,
    local_file: str,
    hub_config: str,
    hub: tuple[str, ...],
    hub_splits: tuple[str, str],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The training and evaluation rows of a recipe, the first ``train_size`` / ``eval_size`` of each: from the local
    copy (``data_source: local``), the JSON-lines file ``local_file`` of ``dataset``
    (:func:`~lightning_dp.tasks.local_data.local_data_dir`) cut by :func:`split_in_file_order`; from the Hub, the
    splits ``hub_splits`` of ``datasets.load_dataset(*hub)``.

    Raises:
        LocalDataError: the local copy is missing (the message names ``hub_config``;
            :class:`~lightning_dp.tasks.local_data.LocalDataError`).
        ValueError: the local file has fewer than 2 rows.
    """
    if recipe.data_source == "local":
        path = local_data_dir(recipe.data_dir, dataset, (local_file,), hub_config) / local_file
        with path.open(encoding="utf-8") as handle:
            train, evaluation = split_in_file_order([json.loads(line) for line in handle if line.strip()])
        return train[: recipe.train_size], evaluation[: recipe.eval_size]
    from datasets import load_dataset

    train_split, eval_split = hub_splits
    return (
        first_rows(load_dataset(*hub, split=train_split), recipe.train_size),
        first_rows(load_dataset(*hub, split=eval_split), recipe.eval_size),
    )


def check_max_length(config: PretrainedConfig, max_length: int) -> None:
    """Raise ``ValueError`` when ``max_length`` exceeds the model's position limit (``max_position_embeddings``,
    ``n_positions``); models without one (relative positions, e.g. T5) accept any length."""
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and max_length > limit:
        raise ValueError(f"max_length {max_length} exceeds the model's maximum of {limit} positions; lower max_length")


def parse_recipe(
    recipe_type: type[RecipeArguments], argv: Sequence[str] | None, description: str | None = None
) -> tuple[Any, TrainingArguments, PrivacyArguments]:
    """Parse ``--config FILE.yaml`` and flags into ``(recipe_type, TrainingArguments, PrivacyArguments)``, then seed.

    Python's ``random``, numpy and torch are seeded with ``training.seed`` before the recipe builds anything random (the
    DP noise has its own ``dp_seed``).

    Raises:
        FileNotFoundError, ValueError, SystemExit: as :func:`~lightning_dp.recipes.config.parse_recipe_args`.
    """
    recipe, training, privacy = parse_recipe_args(
        (recipe_type, TrainingArguments, PrivacyArguments), argv, description=description
    )
    set_seed(training.seed)
    return recipe, training, privacy


def script_main(main: Callable[[], object]) -> int:
    """Run a recipe's ``main()`` as its script and return the exit status, as ``lightning-dp`` does.

    0; 2 after one ``PROG: error: ...`` line for a ``ValueError`` (said once per machine under a launcher); 1 for a
    missing optional package. No traceback unless ``LIGHTNING_DP_TRACEBACK=1``.
    """
    program = os.path.relpath(sys.argv[0]) if sys.argv[0] else "recipe"

    def run() -> int:
        try:
            main()
        except LocalDataError:
            if int(os.environ.get("LOCAL_RANK") or 0) > 0:
                return USAGE_ERROR
            raise
        return 0

    return guarded(program, run)


def run_recipe(
    recipe: RecipeArguments,
    training: TrainingArguments,
    privacy: PrivacyArguments,
    *,
    model: nn.Module,
    train_dataset: Dataset,
    evaluate: Callable[[Trainer], dict[str, float]],
    eval_dataset: Dataset | None = None,
    data_collator: Callable | None = None,
    trainer_kwargs: dict[str, Any] | None = None,
    details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train ``model`` (``DPTrainer``, or the plain ``Trainer`` without DP), evaluate it, and write the JSON summary.

    The summary holds the task metrics, the privacy summary (``null`` without DP), the sizes, the trainable parameter
    count, the training and evaluation wall times in seconds, the arguments and the command line.

    Returns:
        The summary dict (on every process).
    """
    common = dict(
        model=model,
        args=training,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        data_collator=data_collator,
        **(trainer_kwargs or {}),
    )
    private = recipe.dp and not privacy.disable_dp
    trainer = DPTrainer(**common, privacy_args=privacy) if private else Trainer(**common)
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    start = time.perf_counter()
    metrics = evaluate(trainer)
    eval_seconds = time.perf_counter() - start
    result = results_record(
        task=recipe.task,
        metrics=metrics,
        privacy_engine=trainer.privacy_engine if private else None,
        model=model,
        train_size=len(train_dataset),
        eval_size=None if eval_dataset is None else len(eval_dataset),
        steps=trainer.state.global_step,
        expected_batch=training.per_device_train_batch_size
        * training.gradient_accumulation_steps
        * training.world_size,
        train_seconds=train_seconds,
        eval_seconds=eval_seconds,
        world_size=training.world_size,
        details=details,
        history=trainer.state.log_history,
        arguments={
            "recipe": asdict(recipe),
            "privacy": asdict(privacy) if private else None,
            "training": {k: _jsonable(v) for k, v in training.to_dict().items()},
        },
    )
    if training.process_index == 0:
        write_results(result, Path(recipe.results_file or Path(training.output_dir) / "results.json"))
    return result


def results_record(
    *,
    task: str,
    metrics: dict[str, float],
    privacy_engine: PrivacyEngine | None,
    model: nn.Module,
    train_size: int,
    eval_size: int | None,
    steps: int,
    expected_batch: int,
    train_seconds: float,
    eval_seconds: float,
    world_size: int,
    arguments: dict[str, Any],
    details: dict[str, Any] | None = None,
    history: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The summary every recipe writes (HF and Lightning alike; ``bench/recipes.py`` renders the docs from it):
    ``dp`` is whether a privacy engine trained the model, ``privacy`` its summary without ``num_params`` (``None``
    without DP or accountant), ``trainable_params`` counted on ``model``, times rounded to 0.1 s, the recipe's
    ``details`` (which may override ``eval_size``), the ``environment`` (versions, threads, CPU kernels:
    :func:`~lightning_dp.runtime.environment.run_environment`), the ``history`` when given (the log rows of an HF run:
    ``step`` with ``loss`` and ``epsilon``, or with ``eval_loss`` and the evaluation metrics; the Trainer's
    ``state.log_history``), then ``arguments`` and the ``command`` line."""
    privacy = None
    if privacy_engine is not None and privacy_engine.accountant is not None:
        privacy = {k: v for k, v in privacy_engine.summary().items() if k != "num_params"}
    return {
        "task": task,
        "dp": privacy_engine is not None,
        "metrics": metrics,
        "privacy": privacy,
        "train_size": train_size,
        "eval_size": eval_size,
        "steps": steps,
        "expected_batch": expected_batch,
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "train_seconds": round(train_seconds, 1),
        "eval_seconds": round(eval_seconds, 1),
        "world_size": world_size,
        **(details or {}),
        "environment": run_environment(next(model.parameters()).device),
        **({} if history is None else {"history": [{k: _jsonable(v) for k, v in row.items()} for row in history]}),
        "arguments": arguments,
        "command": command_line(),
    }


def write_results(result: dict[str, Any], path: Path) -> None:
    """Write a recipe's summary to ``path`` (JSON; parent folders created) and print its headline keys as one line."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n", encoding="utf-8")
    print(json.dumps({k: result[k] for k in ("task", "dp", "metrics", "privacy", "steps", "train_seconds")}))


def command_line() -> str:
    """The command that runs this process, as typed from the working directory: ``python path/to/script.py ARGS``
    for a script, the program's name and arguments for a console script (``lightning-dp fit ...``), and the
    launcher's own command (``accelerate launch --config_file FILE script.py ARGS``) for a process that
    ``accelerate launch`` started (:func:`accelerate_launch_command`): re-running it starts as many processes."""
    launched = accelerate_launch_command()
    if launched is not None:
        return shlex.join(launched)
    program = sys.argv[0]
    head = ["python", os.path.relpath(program)] if program.endswith(".py") else [Path(program).name]
    return shlex.join([*head, *sys.argv[1:]])


#: How ``accelerate launch`` is started: its console script ``accelerate`` (or ``python -m
#: accelerate.commands.accelerate_cli``) followed by the word ``launch``, or the ``accelerate-launch`` console script
#: (or ``python -m accelerate.commands.launch``) on its own.
_ACCELERATE_CLI = ("accelerate", "accelerate.commands.accelerate_cli")
_ACCELERATE_LAUNCH = ("accelerate-launch", "accelerate.commands.launch")


def accelerate_launch_command(parent_cmdline: Path | None = None) -> list[str] | None:
    """``["accelerate", "launch", *its arguments]`` when this process was started by ``accelerate launch``, else
    ``None``.

    Read from the parent process's command line (``/proc/<ppid>/cmdline``; ``None`` where absent, or for any other
    parent). ``parent_cmdline``: another file to read (tests).
    """
    path = parent_cmdline or Path(f"/proc/{os.getppid()}/cmdline")
    try:
        words = [word for word in path.read_bytes().decode(errors="replace").split("\0") if word]
    except OSError:
        return None
    for index, word in enumerate(words):
        name = Path(word).name  # a path's last part; a module name (no slash) as it is
        if name in _ACCELERATE_CLI and words[index + 1 : index + 2] == ["launch"]:
            return ["accelerate", "launch", *words[index + 2 :]]
        if name in _ACCELERATE_LAUNCH:
            return ["accelerate", "launch", *words[index + 1 :]]
    return None


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
    except TypeError:
        return str(value)
    return value
