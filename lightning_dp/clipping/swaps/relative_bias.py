"""T5-style relative position bias, per example: HF ``T5Attention`` (and MT5, UMT5, LongT5's full attention,
SwitchTransformers, Pop2Piano, Udop) looks up ``relative_attention_bias`` once with bucket ids ``[q, k]`` that have no
example dimension, and every example adds the same ``[1, H, q, k]`` bias, so the table's gradient reaches the
embedding already summed over the examples.

The swap keeps the module's ``compute_bias`` (run without gradients, only to see its bucket ids) and looks the ids up
again expanded to the examples, ``[B, q, k]``: the bias becomes ``[B, H, q, k]``, the same values, and the embedding's
capture has one row per example (docs/design.md section 4.1). The layers that reuse the bias get it per example too.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from lightning_dp.clipping.swaps.base import SwappedModule, mixed_class, register_swap_rule

_BIAS = "relative_attention_bias"


class PerExampleRelativeBias(SwappedModule):
    """Mixin of the swapped attention: the relative position bias looked up per example."""

    _dp_rows: int

    def add_proxies(self) -> list[str]:
        """No proxy: the bias embedding is hooked as it is."""
        return []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        hidden_states = args[0] if args else kwargs["hidden_states"]
        self._dp_rows = hidden_states.shape[0]
        return super().forward(*args, **kwargs)

    def compute_bias(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``[B, H, q, k]``: the module's own bias ``[1, H, q, k]`` for each of the ``B`` examples.

        Raises:
            ValueError: the module's ``compute_bias`` is not one lookup of ``relative_attention_bias`` whose
                ``[q, k, H]`` values it returns as ``[1, H, q, k]``.
        """
        if not torch.is_grad_enabled():  # nothing is clipped: the module's own bias
            return super().compute_bias(*args, **kwargs)  # type: ignore[misc]  # the swapped class's
        table = getattr(self, _BIAS)
        buckets: list[torch.Tensor] = []
        handle = table.register_forward_pre_hook(lambda module, inputs: buckets.append(inputs[0]))
        try:
            with torch.no_grad():
                shared = super().compute_bias(*args, **kwargs)  # type: ignore[misc]  # the swapped class's
        finally:
            handle.remove()
        if len(buckets) != 1 or buckets[0].ndim != 2:
            raise ValueError(f"{type(self).__name__}.compute_bias does not look up one [q, k] grid of buckets")
        bucket = buckets[0]
        values = table(bucket.expand(self._dp_rows, *bucket.shape)).permute(0, 3, 1, 2)  # [B, H, q, k]
        if values.shape[1:] != shared.shape[1:] or not torch.equal(values[:1].detach(), shared):
            raise ValueError(f"{type(self).__name__}.compute_bias returns other values than its bias lookup")
        return values


def _relative_bias_swap(module: nn.Module) -> type[SwappedModule] | None:
    """The swap for an attention module with a trainable ``relative_attention_bias`` embedding and
    ``compute_bias(query_length, key_length, ...)``."""
    table = getattr(module, _BIAS, None)
    if not isinstance(table, nn.Embedding) or not table.weight.requires_grad:
        return None
    compute_bias = getattr(module, "compute_bias", None)
    if not callable(compute_bias) or not getattr(module, "has_relative_attention_bias", True):
        return None
    if list(inspect.signature(compute_bias).parameters)[:2] != ["query_length", "key_length"]:
        return mixed_class(BlockedRelativeBias, type(module))  # refused at attach: see its swap_problem
    return mixed_class(PerExampleRelativeBias, type(module))


class BlockedRelativeBias(SwappedModule):
    """LongT5's local and transient-global attention: a blocked bias shared by the examples, not swapped but refused
    at attach while its table is trainable."""

    @classmethod
    def swap_problem(cls, module: nn.Module) -> str | None:
        return (
            "its relative position bias is computed per block and shared by every example, so the table's gradient "
            "cannot be split by example; freeze relative_attention_bias (requires_grad=False) or train with LoRA"
        )


register_swap_rule(_relative_bias_swap)
