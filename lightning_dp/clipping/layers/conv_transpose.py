"""Per-sample gradient terms for ``nn.ConvTranspose1d/2d/3d``, as the adjoint of a convolution (docs/design.md section
4.2).

With the output gradient ``G`` zero-padded by ``padding`` and unfolded (the layer's kernel, dilation, stride),
sample ``i`` has patches ``P_i`` (``L x C_out k``, one row per input position; ``output_padding`` positions cropped)
and inputs ``X_i`` (``L x C_in``): ``grad W_i = X_i^T P_i`` for ``W`` ``[C_in, C_out / groups, *kernel]``;
``groups > 1`` is materialised; ``grad b_i = sum_l G_i[:, l]``.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp.clipping.layers.conv import unfold, unfolded_weight_term
from lightning_dp.clipping.layers.registry import register_layer
from lightning_dp.clipping.terms import Term, compute_dtype, reduced, trainable

ConvTranspose = nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d


@register_layer(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
def conv_transpose_terms(layer: ConvTranspose, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Term]:
    """Terms for ``weight`` ``[C_in, C_out / groups, *kernel]`` and ``bias`` ``[C_out]``.

    Args:
        layer: the transposed convolution (stride, padding, output_padding or ``output_size``, dilation, groups).
        activation: its input ``[B, C_in, *spatial]``.
        output_grad: gradient w.r.t. its output ``[B, C_out, *spatial_out]``.
    """
    dtype = compute_dtype(layer.weight)
    batch = output_grad.shape[0]
    grads = output_grad.to(dtype)
    terms: dict[str, Term] = {}
    if layer.weight.requires_grad:
        padding = cast(tuple[int, ...], layer.padding)  # transposed convolutions take no string padding
        padded = F.pad(grads, [p for p in reversed(padding) for _ in range(2)])
        for dim, (n, k, d, s) in enumerate(
            zip(activation.shape[2:], layer.kernel_size, layer.dilation, layer.stride, strict=True), start=2
        ):  # crop the output_padding positions that lie beyond the un-padded full output
            padded = padded.narrow(dim, 0, (n - 1) * s + d * (k - 1) + 1)
        patches = unfold(padded, layer.kernel_size, layer.dilation, layer.stride)  # [B, C_out * k, L]
        inputs = activation.reshape(batch, layer.in_channels, -1).to(dtype)  # [B, C_in, L]
        terms["weight"] = unfolded_weight_term(inputs, patches, layer.groups, layer.weight.shape)
    if trainable(layer, "bias"):
        terms["bias"] = reduced(grads.reshape(batch, layer.out_channels, -1), (2,))
    return terms
