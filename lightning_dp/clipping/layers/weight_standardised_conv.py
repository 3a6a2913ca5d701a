"""Per-sample gradient terms for :class:`~lightning_dp.weight_standardisation.WSConv2d` (scaled weight
standardisation, Brock et al. 2021, Section 4; De et al. 2022).

With ``c_r = w_r - mean(w_r)``, ``a_r = 1 / sqrt(max(|c_r|^2, eps))``, ``u_r = a_r c_r``, the convolution's
per-sample gradient ``v_ir`` w.r.t. ``w_hat_r`` and ``p_ir = u_r . v_ir``: ``gain`` gets ``p_ir``, ``weight`` gets
``gain_r a_r (v_ir - mean(v_ir) - d_r p_ir u_r)`` (``d_r = 0`` where the floor holds). The weight's term is
materialised; the family reads the weight and gain the call used (docs/design.md section 4.2).
"""

from __future__ import annotations

import math

import torch

from lightning_dp.clipping.layers.conv import conv_patches, unfolded_weight_term
from lightning_dp.clipping.layers.registry import register_layer
from lightning_dp.clipping.terms import Materialised, Term, compute_dtype, reduced, sample_scales, trainable
from lightning_dp.weight_standardisation import WSConv2d, standardisation_scale


def _check(layer: WSConv2d) -> str | None:
    """A subclass that standardises its weight another way is not this family's."""
    if type(layer).standardised_weight is not WSConv2d.standardised_weight:
        return (
            f"{type(layer).__name__} overrides WSConv2d.standardised_weight, whose per-sample gradients the "
            "WSConv2d layer family would compute with the parent's formula; register a layer family for it "
            "(lightning_dp.clipping.register_layer)"
        )
    return None


@register_layer(WSConv2d, check=_check, reads_parameters=("weight", "gain"))
def weight_standardised_conv_terms(
    layer: WSConv2d, activation: torch.Tensor, output_grad: torch.Tensor, values: dict[str, torch.Tensor]
) -> dict[str, Term]:
    """Terms for ``weight`` ``[C_out, C_in / groups, kH, kW]``, ``gain`` ``[C_out]`` and ``bias`` ``[C_out]``.

    Args:
        layer: the convolution (any stride, padding, dilation, groups, ``padding_mode``).
        activation: its input ``[B, C_in, H, W]``.
        output_grad: gradient w.r.t. its output ``[B, C_out, H', W']``.
        values: ``weight`` and ``gain`` as the call used them.
    """
    dtype = compute_dtype(layer.weight)
    batch = output_grad.shape[0]
    grads = output_grad.reshape(batch, layer.out_channels, -1).to(dtype)  # [B, C_out, L]
    terms: dict[str, Term] = {}
    if layer.weight.requires_grad or trainable(layer, "gain"):
        patches = conv_patches(layer, activation, dtype)  # [B, groups * N, L]
        weight = values["weight"].to(dtype)
        centred, inverse = standardisation_scale(weight, layer.eps)
        directions = centred * inverse[:, None]  # u_r, [C_out, N]
        grad = unfolded_weight_term(grads, patches, layer.groups, weight.shape).materialise()
        grad = grad.reshape(batch, layer.out_channels, -1)  # v_ir, [B, C_out, N]; pulled back in place below
        projections = torch.einsum("brn,rn->br", grad, directions)  # p_ir, [B, C_out]
        # rounding scale of v_ir: ||sum_t |G_ir[t]| |P_i[:, t]| || <= ||G_ir|| ||P_i||_F (all groups' patches)
        rows = grads.norm(dim=2) * patches.flatten(1).norm(dim=1)[:, None]  # [B, C_out]
        if trainable(layer, "gain"):  # |u_r| = 1: the projection's products are bounded by those of v_ir
            terms["gain"] = Materialised(projections, sample_scales(rows))
        if layer.weight.requires_grad:
            scale = values["gain"].to(dtype) * inverse  # gain_r a_r
            unfloored = (centred.pow(2).sum(1) >= layer.eps).to(dtype)  # d_r
            grad.sub_(grad.mean(2, keepdim=True))
            for row in range(batch):  # one [C_out, N] temporary at a time (B rows may be B K augmented copies)
                grad[row].sub_(directions * (projections[row] * unfloored)[:, None])
            grad.mul_(scale[:, None])
            # the pull-back adds |v| (its mean and its projection on u_r are each at most |v| in l2), scaled
            l2 = 3 * (scale.abs() * rows).norm(dim=1)
            scales = torch.stack([l2 * math.sqrt(weight.numel()), l2])  # l1 <= sqrt(numel) l2
            terms["weight"] = Materialised(grad.reshape(batch, *weight.shape), scales)
    if trainable(layer, "bias"):
        terms["bias"] = reduced(grads, (2,))
    return terms
