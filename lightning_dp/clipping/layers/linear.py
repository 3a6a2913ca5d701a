"""Per-sample gradient terms for ``nn.Linear`` (``s = a W^T + b``) with any number of leading dimensions.

For sample ``i`` with activations ``A_i`` (``T x d_in``, all leading dims after the first flattened into ``T``) and
output gradients ``G_i`` (``T x d_out``): ``grad W_i = G_i^T A_i`` and ``grad b_i = sum_t G_i[t]``
(docs/design.md section 4.2; Li et al. 2022, Section 4).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_dp.clipping.layers.registry import register_layer
from lightning_dp.clipping.terms import Factored, Term, as_sequence, compute_dtype, reduced, tensor, trainable


def affine_terms(
    layer: nn.Module, activation: torch.Tensor, output_grad: torch.Tensor, *, transposed_weight: bool
) -> dict[str, Term]:
    """Terms of an affine map over the last dimension: ``weight`` factored as ``G^T A`` (``[d_out, d_in]``), or
    ``A^T G`` when ``transposed_weight`` (``[d_in, d_out]``, HF ``Conv1D``); ``bias`` ``[d_out]`` materialised.

    Args:
        layer: a module with ``weight`` and optional ``bias``.
        activation: its input ``[B, *lead, d_in]``.
        output_grad: gradient w.r.t. its output ``[B, *lead, d_out]``.
    """
    weight = tensor(layer, "weight")
    dtype = compute_dtype(weight)
    grads = as_sequence(output_grad, dtype)
    terms: dict[str, Term] = {}
    if weight.requires_grad:
        inputs = as_sequence(activation, dtype)
        left, right = (inputs, grads) if transposed_weight else (grads, inputs)
        terms["weight"] = Factored(left, right, weight.shape)
    if trainable(layer, "bias"):
        terms["bias"] = reduced(grads, (1,))
    return terms


def _probe(layer: nn.Linear, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``[2, 3, in_features]`` standard normal inputs in the weight's dtype and device."""
    weight = layer.weight
    return (torch.randn(2, 3, layer.in_features, generator=generator, device=weight.device).to(weight.dtype),)


@register_layer(nn.Linear, probe=_probe)
def linear_terms(layer: nn.Linear, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Term]:
    """Terms for ``weight`` ``[d_out, d_in]`` (factored ``G^T A``) and ``bias`` ``[d_out]`` (materialised)."""
    return affine_terms(layer, activation, output_grad, transposed_weight=False)
