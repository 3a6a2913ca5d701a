"""Per-sample gradient terms for ``nn.Conv1d``, ``nn.Conv2d`` and ``nn.Conv3d``, by unfolding into a linear layer.

Sample ``i``'s patches ``A_i`` (``L x C_in k``) and output gradients ``G_i`` (``L x C_out``) give ``grad W_i = G_i^T
A_i`` (docs/design.md section 4.2); ``groups > 1`` is materialised.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp.clipping.layers.registry import register_layer
from lightning_dp.clipping.terms import (
    Factored,
    Materialised,
    Term,
    compute_dtype,
    product_scales,
    reduced,
    trainable,
)


def conv_patches(
    layer: nn.Conv1d | nn.Conv2d | nn.Conv3d, activation: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Unfolded input ``[B, C_in * prod(kernel), L]`` with ``L`` the number of output positions."""
    mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
    x = F.pad(activation.to(dtype), layer._reversed_padding_repeated_twice, mode=mode)
    return unfold(x, layer.kernel_size, layer.dilation, layer.stride)


def unfold(
    x: torch.Tensor, kernel: tuple[int, ...], dilation: tuple[int, ...], stride: tuple[int, ...]
) -> torch.Tensor:
    """``F.unfold`` (no padding) for any number of spatial dims through strided views (no ``im2col``; docs/design.md
    section 12.6): input ``[B, C, *spatial]``, output ``[B, C * prod(kernel), L]`` in ``F.unfold``'s layout.
    """
    for dim, (k, d, s) in enumerate(zip(kernel, dilation, stride, strict=True), start=2):
        x = x.unfold(dim, d * (k - 1) + 1, s)[..., ::d]  # appends a kernel axis of size k
    n = len(kernel)
    batch, channels = x.shape[:2]
    out_dims = tuple(range(2, 2 + n))
    kernel_dims = tuple(range(2 + n, 2 + 2 * n))
    return x.permute(0, 1, *kernel_dims, *out_dims).reshape(batch, channels * math.prod(kernel), -1)


def unfolded_weight_term(rows: torch.Tensor, patches: torch.Tensor, groups: int, shape: torch.Size) -> Term:
    """The weight term ``grad W_i = R_i P_i^T`` of an unfolded convolution, per group.

    Args:
        rows: ``[B, R, L]``, the factor indexing the weight's first dim (``R = shape[0]``).
        patches: ``[B, K, L]``, the unfolded factor (``K = groups * prod(shape[1:])``, channel-major).
        groups: group ``j`` pairs row block ``j`` with patch block ``j``.
        shape: the weight shape ``[R, K / groups / k, *kernel]``.

    Returns:
        :class:`Factored` (``L`` positions as the sequence) for ``groups == 1``, else materialised ``[B, *shape]``.
    """
    if groups == 1:
        return Factored(rows.transpose(1, 2), patches.transpose(1, 2), shape)
    batch = rows.shape[0]
    grad = torch.einsum(
        "bgol,bgcl->bgoc",
        rows.reshape(batch, groups, rows.shape[1] // groups, -1),
        patches.reshape(batch, groups, patches.shape[1] // groups, -1),
    )
    scales = product_scales(rows.transpose(1, 2), patches.transpose(1, 2))  # bounds every group's block
    return Materialised(grad.reshape(batch, *shape), scales)


@register_layer(nn.Conv1d, nn.Conv2d, nn.Conv3d)
def conv_terms(
    layer: nn.Conv1d | nn.Conv2d | nn.Conv3d, activation: torch.Tensor, output_grad: torch.Tensor
) -> dict[str, Term]:
    """Terms for ``weight`` ``[C_out, C_in / groups, *kernel]`` and ``bias`` ``[C_out]``.

    Args:
        layer: the convolution (stride, padding incl. ``"same"``, dilation, groups, any ``padding_mode``).
        activation: its input ``[B, C_in, *spatial]``.
        output_grad: gradient w.r.t. its output ``[B, C_out, *spatial_out]``.
    """
    dtype = compute_dtype(layer.weight)
    batch = output_grad.shape[0]
    grads = output_grad.reshape(batch, layer.out_channels, -1).to(dtype)  # [B, C_out, L]
    terms: dict[str, Term] = {}
    if layer.weight.requires_grad:
        patches = conv_patches(layer, activation, dtype)  # [B, C_in * k, L]
        terms["weight"] = unfolded_weight_term(grads, patches, layer.groups, layer.weight.shape)
    if trainable(layer, "bias"):
        terms["bias"] = reduced(grads, (2,))
    return terms
