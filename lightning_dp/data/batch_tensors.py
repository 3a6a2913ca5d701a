"""The tensors of a batch of any structure (tuples, lists, dicts, dataclasses of tensors)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection


def batch_tensors(batch: Any, min_ndim: int = 0) -> list[torch.Tensor]:
    """Every tensor of ``batch`` with at least ``min_ndim`` dimensions, in ``apply_to_collection``'s order (the order
    in which ``apply_to_collection(batch, torch.Tensor, fn)`` visits them, so the list can be zipped back)."""
    found: list[torch.Tensor] = []
    apply_to_collection(batch, torch.Tensor, lambda t: found.append(t) if t.ndim >= min_ndim else None)
    return found


def leading_rows(batch: Mapping[str, Any]) -> int | None:
    """Rows of the first tensor with at least one dimension among the values of ``batch`` (a HF batch, ``{name:
    tensor}``), in their order, not looking inside nested values; ``None`` when there is none."""
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.ndim:
            return value.shape[0]
    return None
