"""Per-example losses ``[B]`` for the standard HF heads, from the model's logits and the batch's labels.

A causal LM's labels are shifted by one; seq2seq and token classifiers score every label position; a sequence
classifier has one label (vector) per example. Token losses are reduced by ``"mean"`` over the example's labelled
tokens (labels ``-100`` ignored) or ``"sum"``; an example with no labelled token has loss 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.auto import modeling_auto

HeadKind = Literal["causal_lm", "seq2seq_lm", "token_classification", "sequence_classification"]
IGNORE_INDEX = -100

#: HF auto-class mappings (model type -> class name) whose classes have each head.
_HEAD_MAPPINGS: dict[HeadKind, tuple[str, ...]] = {
    "causal_lm": ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",),
    "seq2seq_lm": ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",),
    "token_classification": ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",),
    "sequence_classification": ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",),
}


def _class_names(kind: HeadKind) -> set[str]:
    names: set[str] = set()
    for mapping in _HEAD_MAPPINGS[kind]:
        for value in getattr(modeling_auto, mapping).values():
            names.update([value] if isinstance(value, str) else value)
    return names


def head_kind(model: nn.Module) -> HeadKind:
    """The head of ``model`` (a PEFT model is looked through to its base model), from HF's auto-class mappings.

    Raises:
        ValueError: the model is none of a causal LM, seq2seq LM, token or sequence classifier, with what to do.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    classes = [cls.__name__ for cls in type(base).__mro__]
    for kind in _HEAD_MAPPINGS:
        if any(name in _class_names(kind) for name in classes):
            return kind
    raise ValueError(
        f"DPTrainer cannot make the loss of {type(base).__name__} per example: supported heads are causal LM "
        "(AutoModelForCausalLM), seq2seq LM (AutoModelForSeq2SeqLM), token and sequence classification. For "
        "another model, subclass DPTrainer and override compute_per_example_loss(model, inputs) to return one "
        "loss per example, shape [B]"
    )


def reduce_token_losses(
    token_losses: torch.Tensor, labels: torch.Tensor, reduction: Literal["mean", "sum"]
) -> torch.Tensor:
    """``[B, T]`` token losses -> ``[B]``: sum, or mean over each row's labels that are not ``-100``."""
    mask = labels != IGNORE_INDEX
    total = (token_losses * mask).sum(dim=1)
    if reduction == "sum":
        return total
    return total / mask.sum(dim=1).clamp(min=1)


def token_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    reduction: Literal["mean", "sum"],
    *,
    shift: bool,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-example cross-entropy of token predictions.

    Args:
        logits: ``[B, T, V]`` (upcast to float32 when in half precision, as HF's own losses do).
        labels: ``[B, T]`` token ids, ``-100`` for positions without a target.
        reduction: ``"mean"`` or ``"sum"`` over each example's labelled tokens.
        shift: causal LM: position ``t`` predicts label ``t + 1``.
        label_smoothing: as ``TrainingArguments.label_smoothing_factor``.

    Returns:
        ``[B]`` losses.
    """
    if shift:  # shift the labels, not the logits: slicing [B, T, V] logits would copy them (as HF's own loss)
        labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    token_losses = F.cross_entropy(
        logits.flatten(0, 1),
        labels.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="none",
        label_smoothing=label_smoothing,
    ).view(labels.shape)
    return reduce_token_losses(token_losses, labels, reduction)


def sequence_classification_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    problem_type: str | None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-example loss of a sequence classifier, with HF's choice of loss by ``config.problem_type``.

    ``problem_type`` None is resolved as HF's ``*ForSequenceClassification`` do: one output -> regression, integer
    labels -> single-label, otherwise multi-label.

    Args:
        logits: ``[B, num_labels]``.
        labels: ``[B]`` class ids or targets, or ``[B, num_labels]`` multi-label targets.

    Returns:
        ``[B]``: cross-entropy, squared error (mean over outputs), or binary cross-entropy (mean over labels).
    """
    num_labels = logits.shape[-1]
    if problem_type is None:
        if num_labels == 1:
            problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem_type = "single_label_classification"
        else:
            problem_type = "multi_label_classification"
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if problem_type == "regression":
        return (logits.view(labels.shape[0], -1) - labels.view(labels.shape[0], -1).to(logits.dtype)).square().mean(1)
    if problem_type == "single_label_classification":
        return F.cross_entropy(
            logits.view(-1, num_labels), labels.view(-1), reduction="none", label_smoothing=label_smoothing
        )
    if problem_type == "multi_label_classification":
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none").mean(1)
    raise ValueError(f"Unknown config.problem_type {problem_type!r}")


def head_per_example_loss(
    model: nn.Module,
    inputs: Mapping[str, Any],
    head: HeadKind | None,
    reduction: Literal["mean", "sum"],
    *,
    label_smoothing: float = 0.0,
    config: Any = None,
) -> torch.Tensor:
    """The forward of ``model`` on ``inputs`` and its per-example losses for ``head`` (the body of
    ``DPTrainer.compute_per_example_loss``).

    Args:
        model: the (training) model.
        inputs: the batch on the device, with ``labels``.
        head: the model's head (:func:`head_kind`); ``None`` scores every label position as is.
        reduction: ``"mean"`` or ``"sum"`` over each example's labelled tokens.
        label_smoothing: as ``TrainingArguments.label_smoothing_factor`` (cross-entropy heads).
        config: the model's config, whose ``problem_type`` picks a sequence classifier's loss.

    Returns:
        ``[B]`` per-example losses, attached to the graph.

    Raises:
        ValueError: the batch has no ``labels``.
    """
    if "labels" not in inputs:
        raise ValueError("DPTrainer needs 'labels' in every training batch to form per-example losses")
    if head == "seq2seq_lm" and "decoder_input_ids" not in inputs:
        labels = inputs["labels"]
        logits = model(**inputs).logits
    else:
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        logits = model(**inputs).logits
    if head == "sequence_classification":
        return sequence_classification_loss(
            logits, labels, problem_type=getattr(config, "problem_type", None), label_smoothing=label_smoothing
        )
    return token_cross_entropy(logits, labels, reduction, shift=head == "causal_lm", label_smoothing=label_smoothing)
