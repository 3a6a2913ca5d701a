"""Per-sample gradient terms for :class:`~lightning_dp.weight_standardisation.WSConv2d` (scaled weight
standardisation, Brock et al. 2021, Section 4; De et al. 2022's convolutions).

The layer convolves with ``w_hat_r = gain_r * a_r * c_r`` per output channel ``r``, where ``c_r = w_r - mean(w_r)``
(``N`` values) and ``a_r = 1 / sqrt(max(|c_r|^2, eps))``. Sample ``i``'s gradient with respect to ``w_hat_r`` is
the plain convolution's, ``v_ir = sum_t G_i[r, t] P_i[:, t]`` (output gradients ``G_i``, unfolded patches ``P_i``,
:mod:`~lightning_dp.clipping.conv`). Pulled back through the standardisation, with ``u_r = a_r c_r`` (unit norm and
orthogonal to the all-ones vector when ``|c_r|^2 >= eps``) and ``p_ir = u_r . v_ir``:

- ``gain``: ``grad_ir = p_ir``;
- ``weight``: ``grad_ir = gain_r a_r (v_ir - mean(v_ir) - d_r p_ir u_r)``, with ``d_r = 1`` when
  ``|c_r|^2 >= eps`` and 0 when the floor is active (the Jacobian of ``c / |c|`` is ``(I - u u^T) / |c|``, that of
  the centring ``I - 1 1^T / N``).

For ``groups == 1`` the weight term stays factored (ghost norms, book-keeping): ``v_ir - mean(v_ir)`` is
``G_i`` against the patches centred over their ``N`` entries, and the correction ``-d_r p_ir u_r`` adds ``C_out``
rows, so ``grad_i = L_i^T R_i`` with ``L_i = [G_i^T diag(gain a); -diag(gain a d p_i)]`` (``[L + C_out, C_out]``)
and ``R_i = [P_i^T - mean; U]`` (``[L + C_out, N]``, ``U`` the rows ``u_r``). For ``groups > 1`` it is
materialised. Exact for every engine; tested against ``torch.func`` per-sample gradients.
"""

from __future__ import annotations

import torch

from lightning_dp.clipping.conv import conv_patches, unfolded_weight_term
from lightning_dp.clipping.registry import register_layer
from lightning_dp.clipping.terms import Factored, Materialised, Term, compute_dtype, trainable
from lightning_dp.weight_standardisation import WSConv2d, standardisation_scale


def _projections(grads: torch.Tensor, patches: torch.Tensor, directions: torch.Tensor, groups: int) -> torch.Tensor:
    """``p_ir = u_r . v_ir`` ``[B, C_out]`` without forming ``v``: ``sum_t G_i[r, t] (u_r . P_i[group(r), t])``.

    Args:
        grads: ``[B, C_out, L]``; patches: ``[B, groups * N, L]``; directions: ``[C_out, N]``.
    """
    batch, out_channels, positions = grads.shape
    per_group = directions.reshape(groups, out_channels // groups, -1)
    blocks = patches.reshape(batch, groups, -1, positions)
    responses = torch.einsum("gon,bgnl->bgol", per_group, blocks).reshape(batch, out_channels, positions)
    return (grads * responses).sum(2)


@register_layer(WSConv2d)
def weight_standardised_conv_terms(
    layer: WSConv2d, activation: torch.Tensor, output_grad: torch.Tensor
) -> dict[str, Term]:
    """Terms for ``weight`` ``[C_out, C_in / groups, kH, kW]``, ``gain`` ``[C_out]`` and ``bias`` ``[C_out]``.

    Args:
        layer: the convolution (any stride, padding, dilation, groups, ``padding_mode``).
        activation: its input ``[B, C_in, H, W]``.
        output_grad: gradient w.r.t. its output ``[B, C_out, H', W']``.
    """
    dtype = compute_dtype(layer.weight)
    batch = output_grad.shape[0]
    grads = output_grad.reshape(batch, layer.out_channels, -1).to(dtype)  # [B, C_out, L]
    terms: dict[str, Term] = {}
    if layer.weight.requires_grad or trainable(layer, "gain"):
        patches = conv_patches(layer, activation, dtype)  # [B, groups * N, L]
        centred, inverse = standardisation_scale(layer.weight.detach().to(dtype), layer.eps)
        directions = centred * inverse[:, None]  # u_r, [C_out, N]
        projections = _projections(grads, patches, directions, layer.groups)  # p_ir, [B, C_out]
        if trainable(layer, "gain"):
            terms["gain"] = Materialised(projections)
        if layer.weight.requires_grad:
            scale = layer.gain.detach().to(dtype) * inverse  # gain_r a_r
            unfloored = (centred.pow(2).sum(1) >= layer.eps).to(dtype)  # d_r
            correction = projections * (scale * unfloored)  # gain_r a_r d_r p_ir, [B, C_out]
            terms["weight"] = _weight_term(layer, grads, patches, directions, scale, correction)
    if trainable(layer, "bias"):
        terms["bias"] = Materialised(grads.sum(2))
    return terms


def _weight_term(
    layer: WSConv2d,
    grads: torch.Tensor,
    patches: torch.Tensor,
    directions: torch.Tensor,
    scale: torch.Tensor,
    correction: torch.Tensor,
) -> Term:
    """``grad_ir = scale_r (v_ir - mean(v_ir)) - correction_ir u_r`` (see the module docstring), factored for
    ``groups == 1``, else materialised ``[B, *weight.shape]``."""
    batch, out_channels = correction.shape
    shape = layer.weight.shape
    if layer.groups == 1:
        centred_patches = patches - patches.mean(1, keepdim=True)  # centred over the N entries of each position
        left = torch.cat([(grads * scale[:, None]).transpose(1, 2), torch.diag_embed(-correction)], dim=1)
        right = torch.cat([centred_patches.transpose(1, 2), directions.expand(batch, out_channels, -1)], dim=1)
        return Factored(left, right, shape)
    plain = unfolded_weight_term(grads, patches, layer.groups, shape).materialise().reshape(batch, out_channels, -1)
    pulled = scale[:, None] * (plain - plain.mean(2, keepdim=True)) - correction[:, :, None] * directions
    return Materialised(pulled.reshape(batch, *shape))
