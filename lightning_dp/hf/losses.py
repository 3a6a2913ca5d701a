"""Per-example losses ``[B]`` for the standard HF heads, from the model's logits and the batch's labels.

A causal LM's labels are shifted by one; seq2seq LMs and token classifiers score every label position; sequence,
image and audio classifiers have one label (vector) per example. Token losses are reduced by ``"mean"`` over the
example's labelled tokens (labels ``-100`` ignored) or ``"sum"``; an example with no labelled token has loss 0.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.auto import modeling_auto

HeadKind = Literal[
    "causal_lm",
    "seq2seq_lm",
    "token_classification",
    "sequence_classification",
    "image_classification",
    "audio_classification",
]
IGNORE_INDEX = -100

#: Heads with one label (or label vector) per example, scored by :func:`sequence_classification_loss`.
ONE_LABEL_HEADS: frozenset[HeadKind] = frozenset(
    {"sequence_classification", "image_classification", "audio_classification"}
)

#: The head families: HF auto-class mappings (model type -> class name) and class-name suffixes. ``"lm"`` is split
#: into causal and seq2seq by :func:`_lm_kind`.
_FAMILIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "image_classification": (("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",), ("ForImageClassification",)),
    "audio_classification": (("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",), ("ForAudioClassification",)),
    "sequence_classification": (("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",), ("ForSequenceClassification",)),
    "token_classification": (("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",), ("ForTokenClassification",)),
    "lm": (
        (
            "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
            "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
            "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
        ),
        ("ForCausalLM", "ForConditionalGeneration", "ForSeq2SeqLM"),
    ),
}

#: What to do with a model of another head (one line).
OVERRIDE_HINT = (
    "subclass DPTrainer and override compute_per_example_loss(model, inputs) to return one loss per example, shape [B]"
)


@functools.cache
def _class_names(family: str) -> frozenset[str]:
    names: set[str] = set()
    for mapping in _FAMILIES[family][0]:
        for value in getattr(modeling_auto, mapping, {}).values():
            names.update([value] if isinstance(value, str) else value)
    return frozenset(names)


def _lm_kind(model: nn.Module) -> HeadKind:
    """A language model is seq2seq when it is an encoder-decoder (``config.is_encoder_decoder``; without a config,
    when its forward takes ``decoder_input_ids``), else causal."""
    encoder_decoder = getattr(getattr(model, "config", None), "is_encoder_decoder", None)
    if not isinstance(encoder_decoder, bool):
        encoder_decoder = "decoder_input_ids" in inspect.signature(model.forward).parameters
    return "seq2seq_lm" if encoder_decoder else "causal_lm"


def head_kind(model: nn.Module) -> HeadKind:
    """The head of ``model`` (a PEFT model is looked through to its base model): the first class of its MRO that
    HF's auto-class mappings list, or whose name ends with a head's suffix (``ForImageClassification``,
    ``ForAudioClassification``, ``ForSequenceClassification``, ``ForTokenClassification``, ``ForCausalLM``,
    ``ForConditionalGeneration``, ``ForSeq2SeqLM``).

    Raises:
        ValueError: the model has none of these heads (one line, saying to override ``compute_per_example_loss``).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for cls in type(base).__mro__:
        for family, (_, suffixes) in _FAMILIES.items():
            if cls.__name__ in _class_names(family) or cls.__name__.endswith(suffixes):
                return _lm_kind(base) if family == "lm" else cast(HeadKind, family)
    raise ValueError(
        f"DPTrainer cannot make the loss of {type(base).__name__} per example (the built-in losses cover "
        "*ForCausalLM, seq2seq LMs, *ForTokenClassification, *ForSequenceClassification, *ForImageClassification "
        f"and *ForAudioClassification): {OVERRIDE_HINT}"
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
    """Per-example loss of a sequence, image or audio classifier, with HF's choice of loss by ``config.problem_type``.

    ``problem_type`` None is resolved as HF's classifiers do: one output -> regression, integer labels ->
    single-label, otherwise multi-label.

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
        config: the model's config, whose ``problem_type`` picks a sequence, image or audio classifier's loss.

    Returns:
        ``[B]`` per-example losses, attached to the graph.

    Raises:
        ValueError: the batch has no ``labels``; a token head's logits ``[B, T, V]`` not aligned with its labels
            ``[B, T]``; an unknown ``config.problem_type``.
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
    if head in ONE_LABEL_HEADS:
        return sequence_classification_loss(
            logits, labels, problem_type=getattr(config, "problem_type", None), label_smoothing=label_smoothing
        )
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"DPTrainer's {head or 'token'} loss needs logits [B, T, V] aligned with labels [B, T], got logits "
            f"{list(logits.shape)} and labels {list(labels.shape)}: {OVERRIDE_HINT}"
        )
    return token_cross_entropy(logits, labels, reduction, shift=head == "causal_lm", label_smoothing=label_smoothing)
