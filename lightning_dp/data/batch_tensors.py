"""The tensors of a batch of any structure (tuples, lists, dicts, dataclasses of tensors), and its number of examples.
A marked per-example sequence (:mod:`lightning_dp.data.example_lists`) is one entry per example: what it holds is not
looked into."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_dp.data.example_lists import EXAMPLE_SEQUENCES


def batch_tensors(batch: Any, min_ndim: int = 0) -> list[torch.Tensor]:
    """Every tensor of ``batch`` with at least ``min_ndim`` dimensions outside its marked per-example sequences, in
    ``apply_to_collection``'s order (the order in which ``apply_to_collection(batch, (torch.Tensor,
    *EXAMPLE_SEQUENCES), fn)`` visits them, so the list can be zipped back)."""
    return [
        value for value in _examples_or_tensors(batch) if isinstance(value, torch.Tensor) and value.ndim >= min_ndim
    ]


def first_rows(batch: Any) -> int | None:
    """The number of examples of ``batch``: the rows of its first tensor of one dimension or more (outside marked
    sequences), else the entries of its first marked per-example sequence; ``None`` without either."""
    values = _examples_or_tensors(batch)
    tensors = [value for value in values if isinstance(value, torch.Tensor) and value.ndim]
    if tensors:
        return tensors[0].shape[0]
    sequences = [value for value in values if not isinstance(value, torch.Tensor)]
    return len(sequences[0]) if sequences else None


def holds_rows(batch: Any, size: int) -> bool:
    """Whether a tensor of ``batch`` has ``size`` rows, or a marked per-example sequence ``size`` entries."""
    return any(
        len(value) == size if not isinstance(value, torch.Tensor) else value.ndim > 0 and value.shape[0] == size
        for value in _examples_or_tensors(batch)
    )


def _examples_or_tensors(batch: Any) -> list[Any]:
    found: list[Any] = []
    apply_to_collection(batch, (torch.Tensor, *EXAMPLE_SEQUENCES), found.append)
    return found


def leading_rows(batch: Mapping[str, Any]) -> int | None:
    """Rows of the first tensor with at least one dimension among the values of ``batch`` (a HF batch, ``{name:
    tensor}``), in their order, not looking inside nested values; else the entries of its first marked per-example
    sequence among them (as :func:`first_rows` orders them); ``None`` when there is neither."""
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.ndim:
            return value.shape[0]
    for value in batch.values():
        if isinstance(value, EXAMPLE_SEQUENCES):
            return len(value)
    return None
