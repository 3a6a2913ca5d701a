"""Per-sample gradient terms for normalisation layers: LayerNorm, GroupNorm, InstanceNorm (affine, without running
statistics) and scale-only RMS norms.

All have an output affine in the parameters, ``y = xhat * w + b`` with ``xhat`` the normalised input, so the
per-sample gradients are ``grad w_i = sum (G_i * xhat_i)`` and ``grad b_i = sum G_i``, summed over the dimensions
the parameter is broadcast over. They are small and always materialised (docs/design.md section 4.2).

Scale-only norm rule: a module is treated as an RMS norm if it is a ``torch.nn.RMSNorm``, or if its class name ends
with ``"RMSNorm"`` (HF ``LlamaRMSNorm``, ``MistralRMSNorm``, ``Qwen2RMSNorm``, ``GemmaRMSNorm``, ...), it has no
child modules and its only direct parameter is ``weight``. That weight must have the shape of the trailing input
dims, and the output must be affine in ``weight`` (``xhat * w`` as in Llama, or ``xhat * (1 + w)`` as in Gemma);
``xhat`` is then recovered exactly, whatever the module's epsilon attribute or dtype handling, as
``f(x; w=1) - f(x; w=0)``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from lightning_dp.clipping.layers.registry import register_layer, register_layer_rule
from lightning_dp.clipping.terms import Term, compute_dtype, reduced, tensor, trainable


def _affine_terms(
    layer: nn.Module, xhat: torch.Tensor, output_grad: torch.Tensor, reduce_dims: tuple[int, ...]
) -> dict[str, Term]:
    """Materialised terms ``sum_{reduce_dims} G * xhat`` for ``weight`` and ``sum_{reduce_dims} G`` for ``bias``."""
    grads = output_grad.to(xhat.dtype)
    terms: dict[str, Term] = {}
    if trainable(layer, "weight"):
        terms["weight"] = reduced(grads * xhat, reduce_dims)
    if trainable(layer, "bias"):
        terms["bias"] = reduced(grads, reduce_dims)
    return terms


def _leading_dims(x: torch.Tensor, param_ndim: int) -> tuple[int, ...]:
    """Dims between the sample dim and the trailing ``param_ndim`` dims: ``(1, ..., x.ndim - param_ndim - 1)``."""
    return tuple(range(1, x.ndim - param_ndim))


@register_layer(nn.LayerNorm)
def layer_norm_terms(layer: nn.LayerNorm, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Term]:
    """Terms for ``weight`` and ``bias`` ``[*normalized_shape]``; activation ``[B, *lead, *normalized_shape]``."""
    dtype = compute_dtype(layer.weight)
    xhat = F.layer_norm(activation.to(dtype), layer.normalized_shape, None, None, layer.eps)
    return _affine_terms(layer, xhat, output_grad, _leading_dims(activation, len(layer.normalized_shape)))


@register_layer(nn.GroupNorm)
def group_norm_terms(layer: nn.GroupNorm, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Term]:
    """Terms for ``weight`` and ``bias`` ``[C]``; activation ``[B, C, *spatial]``."""
    dtype = compute_dtype(layer.weight)
    xhat = F.group_norm(activation.to(dtype), layer.num_groups, None, None, layer.eps)
    return _affine_terms(layer, xhat, output_grad, tuple(range(2, activation.ndim)))


@register_layer(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
def instance_norm_terms(
    layer: nn.modules.instancenorm._InstanceNorm, activation: torch.Tensor, output_grad: torch.Tensor
) -> dict[str, Term]:
    """Terms for ``weight`` and ``bias`` ``[C]`` (``affine=True``); activation ``[B, C, *spatial]``, normalised per
    sample and channel over ``spatial``. ``track_running_stats=True`` is rejected by validation (unnoised buffers)."""
    dtype = compute_dtype(layer.weight)
    xhat = F.instance_norm(activation.to(dtype), eps=layer.eps)
    return _affine_terms(layer, xhat, output_grad, tuple(range(2, activation.ndim)))


@register_layer(nn.RMSNorm)
def rms_norm_terms(layer: nn.RMSNorm, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Term]:
    """Term for ``weight`` ``[*normalized_shape]``; ``eps=None`` means the machine epsilon of the input dtype."""
    dtype = compute_dtype(layer.weight)
    eps = torch.finfo(activation.dtype).eps if layer.eps is None else layer.eps
    xhat = F.rms_norm(activation.to(dtype), layer.normalized_shape, None, eps)
    return _affine_terms(layer, xhat, output_grad, _leading_dims(activation, len(layer.normalized_shape)))


def is_scale_only_rms_norm(module: nn.Module) -> bool:
    """The third-party RMS norm rule of this module's docstring (class name, no children, only ``weight``)."""
    return (
        type(module).__name__.endswith("RMSNorm")
        and next(module.children(), None) is None
        and [name for name, _ in module.named_parameters(recurse=False)] == ["weight"]
    )


@register_layer_rule(is_scale_only_rms_norm)
def scale_only_norm_terms(layer: nn.Module, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Term]:
    """Term for ``weight`` of a third-party RMS norm, with ``xhat = f(x; w=1) - f(x; w=0)``."""
    weight = tensor(layer, "weight")
    # plain tensors even for a sharded weight
    like: dict[str, Any] = {"dtype": weight.dtype, "device": activation.device}
    with torch.no_grad():
        ones = functional_call(layer, {"weight": torch.ones(weight.shape, **like)}, (activation,))
        zeros = functional_call(layer, {"weight": torch.zeros(weight.shape, **like)}, (activation,))
    dtype = compute_dtype(weight)
    xhat = ones.to(dtype) - zeros.to(dtype)
    return _affine_terms(layer, xhat, output_grad, _leading_dims(activation, weight.ndim))
