"""Per-sample gradient terms for mixture-of-experts layers as HF builds them (Mixtral, Qwen2-MoE and their kin):
top-k routers and experts fused into 3-D weights.

Router (class name ending in ``Router``, one ``weight`` ``[E, d]``, returning ``(logits, scores, indices)`` with
``logits = x W^T`` on the rows ``[N, d]``): the terms of a linear layer from the input and the gradient of the logits,
which collects the gradient through the routing scores (Shazeer et al. 2017, "Outrageously large neural networks",
Section 2.1). Experts (class name ending in ``Experts``, ``gate_up_proj`` ``[E, 2f, d]`` and ``down_proj`` ``[E, d,
f]``, called as ``experts(x [N, d], top_k_index [N, k], top_k_weights [N, k])``): token ``t`` routed to expert ``e``
with weight ``w`` adds ``w down_e(act(gate_e x_t) * up_e x_t)`` to its output, so its gradients are
``grad down_e = (w G_t) a_t^T`` and ``grad gate_up_e = dh_t x_t^T`` with ``dh_t`` the gradient at ``gate_up_e x_t``.
Each example's term sums its tokens' (an expert none of its tokens reached gets zero), materialised
``[B, E, ...]``. Both families check at attach, on a probe input, that the module computes what they assume.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp.clipping.layers.fallback import CapturedCall, own_parameters
from lightning_dp.clipping.layers.linear import affine_terms
from lightning_dp.clipping.layers.registry import probe_generator, register_layer_rule
from lightning_dp.clipping.terms import Materialised, Term, compute_dtype, tensor

_EXPERT_PARAMETERS = ["gate_up_proj", "down_proj"]


def _activation(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return cast(Callable[[torch.Tensor], torch.Tensor], module.act_fn)


def is_router(module: nn.Module) -> bool:
    """A top-k router: class name ending in ``Router``, no children, one 2-D parameter ``weight``."""
    params = own_parameters(module)
    return (
        type(module).__name__.endswith("Router")
        and next(module.children(), None) is None
        and list(params) == ["weight"]
        and params["weight"].ndim == 2
    )


def _check_router(layer: nn.Module) -> str | None:
    """Why the router's first output is not ``x W^T`` on a probe input, or None."""
    weight = tensor(layer, "weight")
    generator = probe_generator([weight])
    if generator is None:
        return None
    x = torch.randn(6, weight.shape[1], generator=generator, device=weight.device).to(weight.dtype)
    with torch.no_grad():
        output = type(layer).forward(layer, x)
    logits = output[0] if isinstance(output, tuple) and output else None
    expected = F.linear(x, weight)
    if not isinstance(logits, torch.Tensor) or logits.shape != expected.shape or not torch.allclose(logits, expected):
        return "a router whose first output is not the logits x W^T is not supported; freeze it or register a family"
    return None


@register_layer_rule(is_router, check=_check_router, output_index=0)
def router_terms(layer: nn.Module, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Term]:
    """Terms for ``weight`` ``[E, d]``: a linear layer's, input ``[N, d]``, gradient of the logits ``[N, E]``."""
    return affine_terms(layer, activation.reshape(-1, activation.shape[-1]), output_grad, transposed_weight=False)


def is_fused_experts(module: nn.Module) -> bool:
    """Experts fused into 3-D weights: class name ending in ``Experts``, exactly ``gate_up_proj`` and ``down_proj``
    (3-D) and no parameter in a child, and an ``act_fn``."""
    params = own_parameters(module)
    return (
        type(module).__name__.endswith("Experts")
        and next(module.parameters(), None) is not None
        and len(list(module.parameters())) == len(params)  # children (the activation) hold none
        and sorted(params) == sorted(_EXPERT_PARAMETERS)
        and all(p.ndim == 3 for p in params.values())
        and callable(getattr(module, "act_fn", None))
    )


def _routes(index: torch.Tensor, experts: int) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """``(expert, tokens, slots)`` for every expert some token is routed to (an index ``>= experts`` routes nowhere)."""
    routes = []
    for expert in torch.unique(index).tolist():
        if 0 <= expert < experts:
            tokens, slots = torch.where(index == expert)
            routes.append((expert, tokens, slots))
    return routes


def _expert_forward(layer: nn.Module, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The fused experts' output ``[N, d]`` as this family reads it (the probe's reference)."""
    gate_up, down = tensor(layer, "gate_up_proj"), tensor(layer, "down_proj")
    output = torch.zeros(x.shape[0], down.shape[1], dtype=x.dtype, device=x.device)
    for expert, tokens, slots in _routes(index, gate_up.shape[0]):
        gate, up = F.linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
        hidden = F.linear(_activation(layer)(gate) * up, down[expert])
        output.index_add_(0, tokens, hidden * weights[tokens, slots, None])
    return output


def _check_experts(layer: nn.Module) -> str | None:
    """Why the experts' forward differs from :func:`_expert_forward` on a probe input, or None."""
    weight = tensor(layer, "gate_up_proj")
    generator = probe_generator([weight])
    if generator is None:
        return None
    experts, dim = weight.shape[0], weight.shape[2]
    like: dict[str, Any] = {"generator": generator, "device": weight.device}
    x = torch.randn(7, dim, **like).to(weight.dtype)
    index = torch.randint(0, experts, (7, 2), **like)
    weights = torch.rand(7, 2, **like).to(weight.dtype)
    try:
        with torch.no_grad():
            output = type(layer).forward(layer, x, index, weights)
            expected = _expert_forward(layer, x, index, weights)
    except Exception as error:  # another calling convention
        return f"fused experts called other than experts(x, top_k_index, top_k_weights) ({error}); freeze them"
    scale = float(expected.abs().max().clamp_min(1))
    if output.shape != expected.shape or not torch.allclose(output, expected, rtol=1e-4, atol=1e-5 * scale):
        return "fused experts computing other than down(act(gate) * up) per routed token are not supported; freeze them"
    return None


def _call_inputs(layer: nn.Module, call: CapturedCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden_states, top_k_index, top_k_weights)`` of the call, positional or by keyword."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    inputs = list(call.args[:3]) + [call.kwargs[name] for name in names[len(call.args[:3]) :]]
    return inputs[0], inputs[1], inputs[2]


@register_layer_rule(is_fused_experts, check=_check_experts, captures_call=True)
def fused_experts_terms(
    name: str,
    layer: nn.Module,
    call: CapturedCall,
    output_grad: torch.Tensor,
    values: dict[str, torch.Tensor],
    rows_per_example: int,
) -> dict[str, Term]:
    """Materialised terms ``[B, E, 2f, d]`` (``gate_up_proj``) and ``[B, E, d, f]`` (``down_proj``); the rows
    ``[N, d]`` are ``B`` examples of ``rows_per_example`` tokens, sample-major."""
    x, index, weights = _call_inputs(layer, call)
    gate_up, down = values["gate_up_proj"].detach(), values["down_proj"].detach()
    dtype = compute_dtype(gate_up)
    x, grads, weights = x.to(dtype), output_grad.to(dtype), weights.to(dtype)
    gate_up, down = gate_up.to(dtype), down.to(dtype)
    batch = x.shape[0] // rows_per_example
    example = torch.arange(x.shape[0], device=x.device) // rows_per_example
    grad_gate_up = torch.zeros(batch, *gate_up.shape, dtype=dtype, device=x.device)
    grad_down = torch.zeros(batch, *down.shape, dtype=dtype, device=x.device)
    for expert, tokens, slots in _routes(index, gate_up.shape[0]):
        inputs = x[tokens]  # [P, d]
        with torch.enable_grad():
            hidden = F.linear(inputs, gate_up[expert]).requires_grad_(True)  # [P, 2f]
            gate, up = hidden.chunk(2, dim=-1)
            activated = _activation(layer)(gate) * up  # [P, f]
        weighted = grads[tokens] * weights[tokens, slots, None]  # w G_t, [P, d]
        (hidden_grad,) = torch.autograd.grad(activated, hidden, weighted @ down[expert])
        members = F.one_hot(example[tokens], batch).to(dtype)  # [P, B]
        grad_down[:, expert] = torch.einsum("pb,pi,pj->bij", members, weighted, activated.detach())
        grad_gate_up[:, expert] = torch.einsum("pb,pi,pj->bij", members, hidden_grad, inputs)
    terms: dict[str, Term] = {}
    if tensor(layer, "gate_up_proj").requires_grad:
        terms["gate_up_proj"] = Materialised(grad_gate_up)
    if tensor(layer, "down_proj").requires_grad:
        terms["down_proj"] = Materialised(grad_down)
    return terms
