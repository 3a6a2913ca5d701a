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

peft LoRA on the experts' weights (``LoraConfig(target_parameters=["experts.gate_up_proj", "experts.down_proj"])``,
peft's ``ParamWrapper`` in ``peft/tuners/lora/layer.py``): each wrapper adds ``scaling B_e A_e`` to expert ``e``'s
slice of one weight through a parametrization registered around the wrapped call, so no hook sees its factors used.
The family of the outermost wrapper of the chain (which owns the chain's factors, ``own_parameters``) reruns the
experts' tokens on the effective weights and pulls each example's gradient of an expert's slice back to its factors,
``grad A_e = s B_e^T g_e`` and ``grad B_e = s g_e A_e^T``, token by token (never ``[B, E, out, in]``): materialised
``[B, E r, in]`` and ``[B, out, r E]``, ``B`` times the LoRA parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from lightning_dp.clipping.layers.fallback import (
    RERUN_RTOL,
    CapturedCall,
    is_parameter_wrapper,
    own_parameters,
    wrapped_base,
)
from lightning_dp.clipping.layers.linear import affine_terms
from lightning_dp.clipping.layers.registry import probe_generator, register_layer_rule
from lightning_dp.clipping.terms import Materialised, Term, compute_dtype, tensor

_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


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


def _expert_forward(
    act: Callable[[torch.Tensor], torch.Tensor],
    gate_up: torch.Tensor,
    down: torch.Tensor,
    x: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """The fused experts' output ``[N, d]`` as these families read it (the probes' reference): ``x`` ``[N, d]``,
    ``index`` and ``weights`` ``[N, k]``, ``gate_up`` ``[E, 2f, d]``, ``down`` ``[E, d, f]``."""
    output = torch.zeros(x.shape[0], down.shape[1], dtype=x.dtype, device=x.device)
    for expert, tokens, slots in _routes(index, gate_up.shape[0]):
        gate, up = F.linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
        hidden = F.linear(act(gate) * up, down[expert])
        output.index_add_(0, tokens, hidden * weights[tokens, slots, None])
    return output


def _probe_call(weight: torch.Tensor) -> tuple[torch.Generator, tuple[torch.Tensor, ...]] | None:
    """A generator and probe inputs ``(x [7, d], top_k_index [7, 2], top_k_weights [7, 2])`` for fused experts with
    ``gate_up_proj`` ``weight`` ``[E, 2f, d]``, or None where it cannot be probed (:func:`probe_generator`)."""
    generator = probe_generator([weight])
    if generator is None:
        return None
    experts, dim = weight.shape[0], weight.shape[2]
    like: dict[str, Any] = {"generator": generator, "device": weight.device}
    x = torch.randn(7, dim, **like).to(weight.dtype)
    index = torch.randint(0, experts, (7, 2), **like)
    weights = torch.rand(7, 2, **like).to(weight.dtype)
    return generator, (x, index, weights)


def _agrees(output: Any, expected: torch.Tensor, rtol: float = 1e-4) -> bool:
    """Whether a probe's ``output`` is ``expected`` to ``rtol`` of its largest entry (at least 1)."""
    scale = float(expected.abs().max().clamp_min(1))
    return (
        isinstance(output, torch.Tensor)
        and output.shape == expected.shape
        and torch.allclose(output, expected, rtol=rtol, atol=rtol * 0.1 * scale)
    )


def _check_experts(layer: nn.Module) -> str | None:
    """Why the experts' forward differs from :func:`_expert_forward` on a probe input, or None."""
    probe = _probe_call(tensor(layer, "gate_up_proj"))
    if probe is None:
        return None
    _, inputs = probe
    gate_up, down = tensor(layer, "gate_up_proj"), tensor(layer, "down_proj")
    try:
        with torch.no_grad():
            output = type(layer).forward(layer, *inputs)
            expected = _expert_forward(_activation(layer), gate_up, down, *inputs)
    except Exception as error:  # another calling convention
        return f"fused experts called other than experts(x, top_k_index, top_k_weights) ({error}); freeze them"
    if not _agrees(output, expected):
        return "fused experts computing other than down(act(gate) * up) per routed token are not supported; freeze them"
    return None


def _call_inputs(call: CapturedCall) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hidden_states, top_k_index, top_k_weights)`` of the call, positional or by keyword."""
    names = ("hidden_states", "top_k_index", "top_k_weights")
    inputs = list(call.args[:3]) + [call.kwargs[name] for name in names[len(call.args[:3]) :]]
    return inputs[0], inputs[1], inputs[2]


@dataclass(frozen=True)
class _Route:
    """The tokens of a call routed to one expert, ``P`` of them.

    Attributes:
        expert: the expert.
        members: ``[P, B]``, one-hot: the example of each token.
        factors: per parameter, ``(left [P, out], right [P, in])`` with each example's gradient of the expert's slice
            ``[out, in]`` the sum over its tokens of ``left_t right_t^T``.
    """

    expert: int
    members: torch.Tensor
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]


def _routed(
    act: Callable[[torch.Tensor], torch.Tensor],
    call: CapturedCall,
    output_grad: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    rows_per_example: int,
) -> Iterator[_Route]:
    """Each expert's :class:`_Route` for a call on the rows ``[N, d]`` (``B`` examples of ``rows_per_example`` tokens,
    sample-major), with ``G`` = ``output_grad`` ``[N, d]`` and the weights the call used, ``gate_up`` ``[E, 2f, d]``
    and ``down`` ``[E, d, f]`` (detached, in the compute dtype): ``grad down_e = (w G_t) a_t^T`` and
    ``grad gate_up_e = dh_t x_t^T``."""
    x, index, weights = _call_inputs(call)
    dtype = gate_up.dtype
    x, grads, weights = x.to(dtype), output_grad.to(dtype), weights.to(dtype)
    batch = x.shape[0] // rows_per_example
    example = torch.arange(x.shape[0], device=x.device) // rows_per_example
    for expert, tokens, slots in _routes(index, gate_up.shape[0]):
        inputs = x[tokens]  # [P, d]
        with torch.enable_grad():
            hidden = F.linear(inputs, gate_up[expert]).requires_grad_(True)  # [P, 2f]
            gate, up = hidden.chunk(2, dim=-1)
            activated = act(gate) * up  # [P, f]
        weighted = grads[tokens] * weights[tokens, slots, None]  # w G_t, [P, d]
        (hidden_grad,) = torch.autograd.grad(activated, hidden, weighted @ down[expert])
        members = F.one_hot(example[tokens], batch).to(dtype)  # [P, B]
        factors = {"gate_up_proj": (hidden_grad, inputs), "down_proj": (weighted, activated.detach())}
        yield _Route(expert, members, factors)


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
    dtype = compute_dtype(values["gate_up_proj"])
    gate_up, down = (values[param].detach().to(dtype) for param in _EXPERT_PARAMETERS)
    batch = output_grad.shape[0] // rows_per_example
    like: dict[str, Any] = {"dtype": dtype, "device": gate_up.device}
    grads = {param: torch.zeros(batch, *values[param].shape, **like) for param in _EXPERT_PARAMETERS}
    for route in _routed(_activation(layer), call, output_grad, gate_up, down, rows_per_example):
        for param, (left, right) in route.factors.items():
            grads[param][:, route.expert] = torch.einsum("pb,pi,pj->bij", route.members, left, right)
    return {param: Materialised(grads[param]) for param in _EXPERT_PARAMETERS if tensor(layer, param).requires_grad}


# ------------------------------------------------------------------------------------- peft LoRA on fused experts
def is_lora_fused_experts(module: nn.Module) -> bool:
    """A chain of peft ``ParamWrapper`` (``LoraConfig(target_parameters=[... "experts.gate_up_proj",
    "experts.down_proj"])``) on fused experts (:func:`is_fused_experts`), each adapting one of their 3-D weights."""
    _, base = wrapped_base(module)
    return base is not module and is_fused_experts(base) and set(_wrapped_parameters(module)) <= set(_EXPERT_PARAMETERS)


def _wrapped_parameters(module: nn.Module) -> list[str]:
    names = []
    while is_parameter_wrapper(module):
        names.append(cast(str, module.parameter_name))
        module = cast(nn.Module, module.base_layer)
    return names


@dataclass(frozen=True)
class _LoraFactors:
    """One active adapter of one peft ``ParamWrapper`` on a weight ``[E, out, in]`` of fused experts, read as peft's
    ``ParamWrapper.get_delta_factors`` reads it: ``delta_e = scaling B_e A_e`` with ``A`` = ``lora_A`` ``[E r, in]``
    as ``[E, r, in]`` and ``B`` = ``lora_B`` ``[out, r E]`` as ``[E, out, r]`` (column ``k E + e``).

    Attributes:
        target: the weight adapted, ``gate_up_proj`` or ``down_proj``.
        a_key: ``lora_A``'s weight, by dotted name in the outermost wrapper (:func:`own_parameters`).
        b_key: ``lora_B``'s weight, likewise.
        scaling: the adapter's scaling (``lora_alpha / r``).
        experts: ``E``.
    """

    target: str
    a_key: str
    b_key: str
    scaling: float
    experts: int

    def read(self, values: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(A [E, r, in], B [E, out, r])`` from ``values`` (by dotted name), in ``dtype``."""
        a, b = values[self.a_key].detach().to(dtype), values[self.b_key].detach().to(dtype)
        return a.reshape(self.experts, -1, a.shape[-1]), b.reshape(b.shape[0], -1, self.experts).permute(2, 0, 1)

    def as_parameters(self, grad_a: torch.Tensor, grad_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-sample gradients of ``A`` ``[B, E, r, in]`` and ``B`` ``[B, E, out, r]`` laid out as ``lora_A``'s
        weight ``[B, E r, in]`` and ``lora_B``'s ``[B, out, r E]``."""
        batch, _, out, rank = grad_b.shape
        return grad_a.flatten(1, 2), grad_b.permute(0, 2, 3, 1).reshape(batch, out, rank * self.experts)


def _lora_factors(module: nn.Module) -> list[_LoraFactors]:
    """The adapters a peft ``ParamWrapper`` chain applies in its forward: each wrapper's active adapters, none for a
    wrapper whose adapters are disabled or merged into the base weight."""
    factors, prefix = [], ""
    wrapper: Any = module  # peft's attributes
    while is_parameter_wrapper(wrapper):
        if not (wrapper.merged or wrapper.disable_adapters):
            for adapter in wrapper.active_adapters:
                if adapter in wrapper.lora_A:
                    keys = (f"{prefix}lora_A.{adapter}.weight", f"{prefix}lora_B.{adapter}.weight")
                    scaling, experts = float(wrapper.scaling[adapter]), int(wrapper.num_experts)
                    factors.append(_LoraFactors(str(wrapper.parameter_name), *keys, scaling, experts))
        wrapper = wrapper.base_layer
        prefix += "base_layer."
    return factors


def _effective_weights(
    base: nn.Module, read: list[tuple[_LoraFactors, torch.Tensor, torch.Tensor]], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """``{name: W + sum scaling B_e A_e}`` ``[E, out, in]`` in ``dtype``: the weights the wrapped call used, from the
    base's (frozen) weights and the factors ``(adapter, A, B)``."""
    weights = {param: tensor(base, param).detach().to(dtype) for param in _EXPERT_PARAMETERS}
    for factors, a, b in read:
        weights[factors.target] = weights[factors.target] + factors.scaling * (b @ a)
    return weights


def _check_lora_experts(layer: nn.Module) -> str | None:
    """Why the family cannot serve the ``ParamWrapper`` chain ``layer``, or None: the experts' own weights trainable or
    FSDP2-sharded, experts of other maths (:func:`_check_experts`), or, on a probe input with random LoRA factors, a
    forward other than the experts' on :func:`_effective_weights` (another layout of the factors)."""
    _, base = wrapped_base(layer)
    trainable = [name for name, p in base.named_parameters() if p.requires_grad]
    if trainable:
        return (
            "peft LoRA (target_parameters) on fused experts needs their own weights frozen, but "
            f"{', '.join(trainable)} are trainable; freeze them (requires_grad=False), as peft does by default"
        )
    if any(type(p.data) is not torch.Tensor for p in base.parameters()):
        return (
            "peft LoRA (target_parameters) on FSDP2-sharded fused experts is not supported (their terms read the "
            "experts' weights after the forward); train unsharded (DPDDPStrategy)"
        )
    problem = _check_experts(base)
    factors = _lora_factors(layer)
    probe = _probe_call(tensor(base, "gate_up_proj"))
    if problem is not None or probe is None or not factors:
        return problem
    generator, inputs = probe
    own = own_parameters(layer)
    values = {
        key: torch.randn(own[key].shape, generator=generator, device=own[key].device).to(own[key].dtype)
        for adapter in factors
        for key in (adapter.a_key, adapter.b_key)
    }
    dtype = inputs[0].dtype
    try:
        with torch.no_grad():
            output = functional_call(layer, values, inputs)
            read = [(adapter, *adapter.read(values, dtype)) for adapter in factors]
            weights = _effective_weights(base, read, dtype)
            expected = _expert_forward(_activation(base), weights["gate_up_proj"], weights["down_proj"], *inputs)
    except Exception as error:  # another layout of the factors (shapes), or a forward peft 0.21 does not run
        first_line = (str(error).splitlines() or [""])[0]
        return f"peft LoRA on fused experts fails on a probe input ({first_line}); train LoRA on other modules"
    if not _agrees(output, expected, RERUN_RTOL.get(dtype, 1e-4)):
        return (
            "peft LoRA on fused experts computing other than W_e + scaling B_e A_e (peft 0.21's ParamWrapper layout) "
            "is not supported; use a peft version with that layout, or train LoRA on other modules"
        )
    return None


@register_layer_rule(is_lora_fused_experts, check=_check_lora_experts, captures_call=True)
def lora_fused_experts_terms(
    name: str,
    layer: nn.Module,
    call: CapturedCall,
    output_grad: torch.Tensor,
    values: dict[str, torch.Tensor],
    rows_per_example: int,
) -> dict[str, Term]:
    """Materialised terms of the trainable LoRA factors of a peft ``ParamWrapper`` chain on fused experts, ``[B, E r,
    in]`` (``lora_A``) and ``[B, out, r E]`` (``lora_B``) by dotted name; the rows ``[N, d]`` are ``B`` examples of
    ``rows_per_example`` tokens, sample-major.

    With ``g_e = sum_t left_t right_t^T`` an example's gradient of the effective weight ``W_e + s B_e A_e`` of expert
    ``e`` (:func:`_routed`, on the effective weights), ``grad A_e = s B_e^T g_e = s sum_t (B_e^T left_t) right_t^T``
    and ``grad B_e = s g_e A_e^T = s sum_t left_t (A_e right_t)^T``: ``[B, E, r, in + out]`` per adapter, never
    ``[B, E, out, in]``. An expert none of an example's tokens reached gets zero.
    """
    factors = _lora_factors(layer)
    if not factors:
        return {}
    dtype = compute_dtype(values[factors[0].a_key])
    read = [(adapter, *adapter.read(values, dtype)) for adapter in factors]
    _, base = wrapped_base(layer)
    weights = _effective_weights(base, read, dtype)
    batch = output_grad.shape[0] // rows_per_example
    like: dict[str, Any] = {"dtype": dtype, "device": output_grad.device}
    grads = [(torch.zeros(batch, *a.shape, **like), torch.zeros(batch, *b.shape, **like)) for _, a, b in read]
    routes = _routed(
        _activation(base), call, output_grad, weights["gate_up_proj"], weights["down_proj"], rows_per_example
    )
    for route in routes:
        for (adapter, a, b), (grad_a, grad_b) in zip(read, grads, strict=True):
            left, right = route.factors[adapter.target]  # [P, out], [P, in]
            e, s = route.expert, adapter.scaling
            grad_a[:, e] = s * torch.einsum("pb,pk,pj->bkj", route.members, left @ b[e], right)
            grad_b[:, e] = s * torch.einsum("pb,pi,pk->bik", route.members, left, right @ a[e].T)
    own = own_parameters(layer)
    terms: dict[str, Term] = {}
    for (adapter, _, _), (grad_a, grad_b) in zip(read, grads, strict=True):
        for key, grad in zip((adapter.a_key, adapter.b_key), adapter.as_parameters(grad_a, grad_b), strict=True):
            if own[key].requires_grad:
                terms[key] = Materialised(grad)
    return terms
