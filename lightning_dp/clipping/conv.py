"""Per-sample gradient terms for ``nn.Conv1d`` and ``nn.Conv2d``, by unfolding the convolution into a linear layer.

After padding (any ``padding_mode``) and unfolding (``F.unfold`` layout), sample ``i`` has patches ``A_i``
(``L x C_in k``, one row per output position) and output gradients ``G_i`` (``L x C_out``); for ``groups == 1``
``grad W_i = G_i^T A_i`` (DESIGN.md section 4, "Conv: unfold to linear"). For ``groups > 1`` each group is its own
linear map; the per-sample gradient (``B * C_out * C_in/groups * k`` values, ``groups`` times smaller than the
ungrouped weight) is materialised. Conv1d is treated as a Conv2d with a ``1 x k`` kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp.clipping.registry import register_layer
from lightning_dp.clipping.terms import Factored, Materialised, Term, compute_dtype, trainable


def _patches(layer: nn.Conv1d | nn.Conv2d, activation: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unfolded input ``[B, C_in * prod(kernel), L]`` with ``L`` the number of output positions."""
    mode = "constant" if layer.padding_mode == "zeros" else layer.padding_mode
    x = F.pad(activation.to(dtype), layer._reversed_padding_repeated_twice, mode=mode)
    if isinstance(layer, nn.Conv1d):
        x = x.unsqueeze(-2)
        kernel, dilation, stride = (1, *layer.kernel_size), (1, *layer.dilation), (1, *layer.stride)
    else:
        kernel, dilation, stride = layer.kernel_size, layer.dilation, layer.stride
    return _unfold(x, kernel, dilation, stride)


def _unfold(
    x: torch.Tensor, kernel: tuple[int, ...], dilation: tuple[int, ...], stride: tuple[int, ...]
) -> torch.Tensor:
    """``F.unfold`` (no padding) through strided views: the same ``[B, C * kh * kw, L]`` layout, but without
    ``im2col``, which is two orders of magnitude slower on some CPU builds of torch (measured: 2 s vs 20 ms for a
    ``[128, 16, 8, 8]`` input, 3x3 kernel, torch 2.13 CPU)."""
    for dim, (k, d, s) in enumerate(zip(kernel, dilation, stride, strict=True), start=2):
        x = x.unfold(dim, d * (k - 1) + 1, s)[..., ::d]  # appends a kernel axis of size k
    batch, channels, out_h, out_w, k_h, k_w = x.shape
    return x.permute(0, 1, 4, 5, 2, 3).reshape(batch, channels * k_h * k_w, out_h * out_w)


@register_layer(nn.Conv1d, nn.Conv2d)
def conv_terms(layer: nn.Conv1d | nn.Conv2d, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Term]:
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
        patches = _patches(layer, activation, dtype)  # [B, C_in * k, L]
        if layer.groups == 1:
            terms["weight"] = Factored(grads.transpose(1, 2), patches.transpose(1, 2), layer.weight.shape)
        else:
            g = layer.groups
            grad = torch.einsum(
                "bgol,bgcl->bgoc",
                grads.reshape(batch, g, layer.out_channels // g, -1),
                patches.reshape(batch, g, patches.shape[1] // g, -1),
            )
            terms["weight"] = Materialised(grad.reshape(batch, *layer.weight.shape))
    if trainable(layer, "bias"):
        terms["bias"] = Materialised(grads.sum(2))
    return terms
