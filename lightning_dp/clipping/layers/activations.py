"""Per-sample gradient terms for activations with a learned parameter: ``nn.PReLU``."""

from __future__ import annotations

import torch
from torch import nn

from lightning_dp.clipping.layers.registry import register_layer
from lightning_dp.clipping.terms import Term, compute_dtype, reduced, trainable


@register_layer(nn.PReLU)
def prelu_terms(layer: nn.PReLU, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Term]:
    """Term for ``weight`` ``[num_parameters]``: ``y = max(0, x) + w min(0, x)``, so ``grad w_i = sum G_i min(0, x_i)``
    over the positions a slope applies to (PReLU: He et al. 2015, section 2.1).

    Args:
        layer: the module; its ``num_parameters`` is 1 (one slope) or the channels ``C``.
        activation: ``[B, C, *spatial]`` (the channels are dim 1, as in ``F.prelu``), or ``[B, *]`` for one slope.
        output_grad: the gradient of the summed loss w.r.t. the output, the shape of ``activation``.
    """
    if not trainable(layer, "weight"):
        return {}
    dtype = compute_dtype(layer.weight)
    values = output_grad.to(dtype) * activation.to(dtype).clamp(max=0)
    if layer.weight.numel() == 1:  # one slope for every position: [B, 1]
        return {"weight": reduced(values.reshape(len(values), 1, -1), (2,))}
    return {"weight": reduced(values, tuple(range(2, values.ndim)))}  # one slope per channel: [B, C]
