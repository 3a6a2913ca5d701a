"""The exact fallback for a module that owns trainable parameters no layer family covers (or that encloses
parameters misplaced at their own module): per-sample gradients of its own parameters from ``torch.func`` (the
approach of Opacus's functorch path, ``GradSampleModule`` with ``force_functorch=True``).

For each example ``i`` the module's forward is rerun on that example's rows alone (``vmap`` over ``[r, ...]`` slices
of every input with the output's row count: one row, or its augmented copies, folded sequence or windows) with its own
parameters as the variables, and ``grad_i = d <f(x_i; w), G_i> / dw``, with ``G_i`` the captured output gradient;
the call's dropout masks and random draws are replayed (:mod:`~.random_replay`). The terms are materialised,
``B * numel`` per parameter. Until a batch of two examples or more confirms each structure and shape of the call, the
rerun outputs are compared with the outputs the forward returned: a module whose example ``i`` depends on other
examples, or whose rerun is not the call, is refused (docs/design.md section 4.2).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Hashable
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn.utils import parametrize
from torch.utils._pytree import TreeSpec, keystr, tree_flatten, tree_flatten_with_path, tree_leaves, tree_unflatten

from lightning_dp.clipping.layers.random_replay import RandomReplay, Records, by_example
from lightning_dp.clipping.layers.registry import LayerFamily, UnsupportedModuleError
from lightning_dp.clipping.layers.rerun_precision import CpuLayerNormInFloat32, in_float32
from lightning_dp.clipping.terms import Materialised, Term, compute_dtype
from lightning_dp.data.example_lists import EXAMPLE_SEQUENCES

log = logging.getLogger("lightning_dp")

#: Relative tolerance (to the largest output entry) of the first batch's comparison, by the output's dtype.
RERUN_RTOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 4e-3}

_ROUTE = (
    "freeze its parameters (requires_grad=False), train it with LoRA, or register a layer family for "
    "{kind} (lightning_dp.clipping.register_layer)"
)


@dataclass
class CapturedCall:
    """The inputs of one call of a module under the fallback (or another family reading the whole call), detached.

    Attributes:
        args: positional arguments (tensors detached).
        kwargs: keyword arguments (tensors detached).
        versions: each input tensor's version counter at the call (an in-place change afterwards is refused).
        autocast: ``(device type, enabled, dtype)`` of autocast at the call; the rerun uses the same.
        signature: the inputs' structure: the pytree spec and each leaf's kind (a tensor's ndim, shape after the first
            dimension and dtype, or the type).
        output: the output the call returned, ``[R, ...]``, while the module's split of this structure is not
            confirmed (the fallback compares its rerun with it); else None.
        batched: the confirmed positions (in the flattened inputs) of the inputs split by example, or None.
        confirmed: set by the fallback when its comparison on two examples or more confirmed a split.
        joined: for a call that returned a structure of tensors (a tuple, an HF ``ModelOutput``), its pytree spec and
            the positions of the distinct tensors requiring grad, joined into one output (:func:`join_outputs`);
            None for a call that returned a tensor.
        draws: the dropout masks and random draws of the call, replayed in the rerun (:mod:`~.random_replay`).
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    versions: list[tuple[torch.Tensor, int]]
    autocast: tuple[str, bool, torch.dtype]
    signature: Hashable
    output: torch.Tensor | None = None
    batched: tuple[int, ...] | None = None
    confirmed: tuple[int, ...] | None = None
    joined: tuple[TreeSpec, tuple[int, ...]] | None = None
    draws: Records = field(default_factory=list)

    @classmethod
    def record(cls, args: tuple[Any, ...], kwargs: dict[str, Any], output: torch.Tensor) -> CapturedCall:
        """Detach the inputs of a call and note their structure and the autocast state."""
        flat, spec = tree_flatten((args, kwargs), is_leaf=_marked)
        tensors = [x.detach() if isinstance(x, torch.Tensor) else x for x in flat]
        versions = [(x, x._version) for x in tensors if isinstance(x, torch.Tensor)]
        detached_args, detached_kwargs = tree_unflatten(tensors, spec)
        device = output.device.type
        autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        kinds = tuple(
            (x.ndim, tuple(x.shape[1:]), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__ for x in flat
        )
        return cls(detached_args, detached_kwargs, versions, autocast, (str(spec), kinds))

    def modified(self) -> bool:
        """Whether an input tensor was modified in place since the call."""
        return any(x._version != version for x, version in self.versions)


def is_parameter_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is a peft LoRA ``ParamWrapper`` (``LoraConfig(target_parameters=...)``, peft's
    ``tuners/lora/layer.py``): it adapts one parameter of its ``base_layer`` (possibly another ``ParamWrapper``) by a
    parametrization registered around the base's call, so its LoRA factors are used outside their own modules."""
    layer = sys.modules.get("peft.tuners.lora.layer")  # not imported: no module can be one
    wrapper = getattr(layer, "ParamWrapper", None)
    return isinstance(wrapper, type) and isinstance(module, wrapper)


def wrapped_base(module: nn.Module) -> tuple[str, nn.Module]:
    """``(prefix, base)``: the module under a chain of peft ``ParamWrapper`` (``module`` itself when it is none) and
    its path prefix in ``module`` (``"base_layer.base_layer."`` under two)."""
    prefix = ""
    while is_parameter_wrapper(module):
        module = cast(nn.Module, module.base_layer)
        prefix += "base_layer."
    return prefix, module


def own_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters a module's call uses as its own: those it registers; for a parametrized module
    (``torch.nn.utils.parametrize``, e.g. ``weight_norm``) the originals its parametrizations compute from, by dotted
    name (``parametrizations.weight.original0``); for a chain of peft ``ParamWrapper`` (:func:`is_parameter_wrapper`)
    the chain's LoRA factors, by dotted name (``lora_A.default.weight``, ``base_layer.lora_B.default.weight``), not
    the wrapped module's parameters."""
    params = dict(module.named_parameters(recurse=False))
    if parametrize.is_parametrized(module):
        parametrizations = cast(nn.ModuleDict, module.parametrizations)
        for name, parametrization in parametrizations.items():
            for attr, original in parametrization.named_parameters(recurse=False):  # original, original0, ...
                params[f"parametrizations.{name}.{attr}"] = original
    if is_parameter_wrapper(module):
        prefix, _ = wrapped_base(module)
        params.update((name, p) for name, p in module.named_parameters() if not name.startswith(prefix))
    return params


def covered_parameters(module: nn.Module, encloses: tuple[str, ...] = ()) -> dict[str, nn.Parameter]:
    """The parameters a family's terms cover for ``module``, by (dotted) name: its own (:func:`own_parameters`), and
    those of the descendants at ``encloses`` (:attr:`LayerFamily.encloses`) as ``'<path>.<name>'``; each once, by its
    first name (a swapped module's proxy registers its parameters again)."""
    params = own_parameters(module)
    seen = {id(param) for param in params.values()}
    for path in encloses:
        for name, param in own_parameters(module.get_submodule(path)).items():
            if id(param) not in seen:
                seen.add(id(param))
                params[f"{path}.{name}"] = param
    return params


def join_outputs(output: Any, name: str, module: nn.Module) -> tuple[torch.Tensor, tuple[int, ...], TreeSpec]:
    """One tensor ``[R, n]`` for a call's structured output: its distinct tensors requiring grad, each flattened to
    ``[R, ...]`` (``R`` the fewest rows among them; one with ``m R`` rows, windows folded into them as Swin's attention
    weights, gives each of its ``R`` rows ``m`` consecutive ones) and concatenated along dimension 1, with their
    positions among the pytree's leaves and the pytree's spec. Rebuild the output from views of it with
    :func:`split_joined` so that its gradient reaches them. The fallback's comparison checks the rows' order.

    Raises:
        UnsupportedModuleError: no such tensor, or one whose rows are not a multiple of ``R``.
    """
    flat, spec = tree_flatten(output)
    positions, seen = [], set()
    for index, leaf in enumerate(flat):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad and id(leaf) not in seen:
            seen.add(id(leaf))
            positions.append(index)
    rows = [flat[i].shape[0] if flat[i].ndim else 0 for i in positions]
    least = min(rows, default=0)
    if not least or any(r % least for r in rows):
        raise UnsupportedModuleError(
            f"module '{name}' ({type(module).__name__}) has trainable parameters no layer family covers, and the exact "
            f"fallback needs every tensor its forward returns to have a multiple of the same rows, one block per "
            f"example (got first dimensions {sorted(set(rows))}); " + _ROUTE.format(kind=type(module).__name__)
        )
    joined = torch.cat([flat[i].reshape(least, -1) for i in positions], dim=1)
    return joined, tuple(positions), spec


def split_joined(output: Any, joined: torch.Tensor, positions: tuple[int, ...]) -> Any:
    """``output`` with each joined tensor (and every other leaf that is the same tensor) replaced by its view of
    ``joined`` (:func:`join_outputs`)."""
    flat, spec = tree_flatten(output)
    views: dict[int, torch.Tensor] = {}
    offset = 0
    for index in positions:
        leaf = flat[index]
        size = leaf.numel() // joined.shape[0]
        views[id(leaf)] = joined[:, offset : offset + size].reshape(leaf.shape).to(leaf.dtype)
        offset += size
    return tree_unflatten([views.get(id(x), x) if isinstance(x, torch.Tensor) else x for x in flat], spec)


def _rejoined(output: Any, joined: tuple[TreeSpec, tuple[int, ...]]) -> torch.Tensor:
    """The rerun's output joined as the call's was (:func:`join_outputs`)."""
    spec, positions = joined
    flat, rerun_spec = tree_flatten(output)
    if rerun_spec != spec:
        raise TypeError("the forward returned another structure than in the call")
    least = min(flat[i].shape[0] for i in positions)
    return torch.cat([flat[i].reshape(least, -1) for i in positions], dim=1)


def fallback_problem(module: nn.Module, sharded: bool) -> str | None:
    """Why the fallback cannot serve ``module``, or None.

    A peft ``ParamWrapper`` registers a parametrization in its forward, which ``torch.func`` cannot rerun: one on other
    than fused experts (:mod:`~lightning_dp.clipping.layers.experts` serves those) is refused. Under FSDP2 the rerun
    reads the parameters of the module's submodules, which are sharded after the forward: a module with parameterised
    submodules, or one that is itself a ``fully_shard`` unit, is refused there.
    """
    if is_parameter_wrapper(module):
        return (
            "peft LoRA through target_parameters is supported on fused mixture-of-experts weights (gate_up_proj, "
            "down_proj) only: the exact fallback cannot rerun its parametrization per sample; adapt this module "
            "through target_modules, or drop it from target_parameters"
        )
    if not sharded:
        return None
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        return "the exact fallback cannot rerun a module that is itself a fully_shard unit; shard its parent instead"
    if any(p is not None for sub in module.children() for p in sub.parameters()):
        return (
            "the exact fallback reruns this module's forward, which reads its submodules' parameters, sharded by "
            "FSDP2 after the forward; train it unsharded (DPDDPStrategy) or "
            + _ROUTE.format(kind=type(module).__name__)
        )
    return None


def describe_fallback(modules: dict[str, tuple[nn.Module, LayerFamily]]) -> str:
    """One line naming the modules served by the fallback (and the descendants each encloses) and the per-sample
    memory they cost (elements per row)."""
    parts, total = [], 0
    for path, (module, family) in modules.items():
        numel = sum(p.numel() for p in covered_parameters(module, family.encloses).values() if p.requires_grad)
        total += numel
        enclosed = f", enclosing {', '.join(repr(sub) for sub in family.encloses)}" if family.encloses else ""
        parts.append(f"'{path or '<root>'}' ({type(module).__name__}, {numel} parameters{enclosed})")
    why = (
        "no layer family covers, or enclosing parameters misplaced at their own module"
        if any(family.encloses for _, family in modules.values())
        else "no layer family covers"
    )
    return (
        f"exact torch.func fallback for {len(modules)} module(s) {why}: {', '.join(parts)}; "
        f"each reruns its forward per sample and materialises B x {total} per-sample gradient entries per call"
    )


def _rerun_error(name: str, module: nn.Module, error: Exception) -> UnsupportedModuleError:
    kind = type(module).__name__
    first_sentence = (str(error).splitlines() or [""])[0].split(". ")[0]
    if "saved tensor hooks" in first_sentence:  # torch.func refuses the saved-tensors hooks checkpointing installs
        why = (
            "it runs activation checkpointing (or save_on_cpu) inside, which torch.func cannot rerun: turn it off "
            "(HF: gradient_checkpointing=False), "
        )
    else:
        why = (
            "a module that draws random numbers other than those replayed (dropout, torch.rand and its kin), "
            "branches on its data or calls .item() is not supported: "
        )
    return UnsupportedModuleError(
        f"module '{name}' ({kind}) cannot be rerun per sample by the exact fallback ({type(error).__name__}: "
        f"{first_sentence}); {why}" + _ROUTE.format(kind=kind)
    )


def fallback_terms(
    name: str,
    layer: nn.Module,
    call: CapturedCall,
    output_grad: torch.Tensor,
    values: dict[str, torch.Tensor],
    rows_per_example: int,
    *,
    encloses: tuple[str, ...] = (),
) -> dict[str, Term]:
    """Materialised terms ``[B, *param.shape]`` for the trainable parameters ``layer`` owns (and those of the
    descendants it ``encloses``), ``B = R / r``: each example's ``r`` rows rerun together.

    Args:
        name: the module's path (for messages).
        layer: the module.
        call: its captured inputs; every tensor input whose first dimension is ``R`` (the output's rows) is split by
            example, the others are passed whole to every example.
        output_grad: ``G`` ``[R, ...]``, the gradient of the summed loss w.r.t. the output.
        values: the parameters as the call used them, by (dotted) name: the module's own, and those of its submodules
            when they may have changed since the call.
        rows_per_example: ``r``, each example's consecutive rows (augmented copies, a folded sequence).
        encloses: paths of descendants whose own parameters are variables too (:func:`enclosing_family`).

    Raises:
        UnsupportedModuleError: the rerun fails under ``vmap`` (random numbers it cannot replay, data-dependent
            control flow), or, while this structure and shape of the call is not confirmed, its output differs from
            the call's (row ``i`` depends on other rows, or the rerun is not the call).
    """
    trainable = [key for key, p in covered_parameters(layer, encloses).items() if p.requires_grad]
    rows = output_grad.shape[0]
    examples = rows // rows_per_example
    flat, spec = tree_flatten((call.args, call.kwargs), is_leaf=_marked)
    batched = _batched_inputs(name, layer, call, flat, rows)
    constants = {key: value.detach() for key, value in values.items() if key not in trainable}

    def run(
        params: dict[str, torch.Tensor],
        inputs: tuple[torch.Tensor, ...],
        example_draws: tuple[torch.Tensor, ...],
        float32: bool = False,
        batch: bool = False,
    ) -> torch.Tensor:
        """The layer's output on one example's ``inputs`` and draws (``batch``: the call's, whole), under the call's
        autocast, or (``float32``) with autocast off and half-precision tensors in float32."""
        leaves = list(flat)
        for index, value in zip(batched, inputs, strict=True):
            leaves[index] = value
        weights = {**constants, **params}
        if float32:  # every parameter and buffer of the module's tree, the call's values first
            weights = {**dict(layer.named_parameters()), **dict(layer.named_buffers()), **weights}
            leaves, weights = [in_float32(v) for v in leaves], {k: in_float32(v.detach()) for k, v in weights.items()}
        args, kwargs = tree_unflatten(leaves, spec)
        replay = RandomReplay(call.draws, {} if batch else dict(zip(draw_indices, example_draws, strict=True)))
        layer_norm = CpuLayerNormInFloat32() if enabled and device == "cpu" else nullcontext()
        with torch.autocast(device, dtype=dtype, enabled=enabled and not float32), replay, layer_norm:
            output = functional_call(layer, weights, tuple(args), kwargs)
        replay.finish()
        if not batch:
            replayed_whole.append(replay.whole)
        if call.joined is not None:
            output = _rejoined(output, call.joined)
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"the forward returned {type(output).__name__}, not a tensor")
        return output

    def example_loss(
        params: dict[str, torch.Tensor],
        example_inputs: tuple[torch.Tensor, ...],
        example_grad: torch.Tensor,
        example_draws: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        output = run(params, example_inputs, example_draws)
        return (output * example_grad.to(output.dtype)).sum(), output

    def split(x: torch.Tensor) -> torch.Tensor:  # [R, ...] -> [B, r, ...]: each example's rows, a batch
        return x.reshape(examples, rows_per_example, *x.shape[1:])

    params = {key: values[key].detach() for key in trainable}
    draw_indices, draws = by_example(call.draws, examples)
    replayed_whole: list[bool] = []
    device, enabled, dtype = call.autocast
    split_inputs = tuple(split(flat[i]) for i in batched)
    try:
        with torch.autocast(device, enabled=False):
            grads, outputs = vmap(grad(example_loss, has_aux=True), in_dims=(None, 0, 0, 0), randomness="error")(
                params, split_inputs, split(output_grad), draws
            )
            called = None if call.output is None else split(call.output)
            reference, reruns = called, outputs
            if called is not None and enabled:  # under autocast the batch's kernels round otherwise than a row's:
                with torch.no_grad():  # mixing is looked for in the batch and the examples rerun in float32
                    whole = run(params, tuple(flat[i] for i in batched), (), float32=True, batch=True)
                    reference = split(torch.broadcast_to(whole, (rows, *called.shape[2:])))
                    rerun = vmap(partial(run, params, float32=True), randomness="error")
                    reruns = rerun(split_inputs, draws) if split_inputs or draws else whole[None]  # parameters alone
    except (RuntimeError, TypeError, ValueError) as error:
        raise _rerun_error(name, layer, error) from error
    if reference is not None and called is not None:  # an output from parameters alone is [1, ...]: broadcast
        _check_rerun(name, layer, reference, reruns)
        if enabled:  # and the call itself under its autocast against the rerun of the gradients, to its rounding
            _check_rerun(name, layer, called, outputs, max(RERUN_RTOL[dtype], RERUN_RTOL.get(called.dtype, 1e-4)))
        # the split was seen to reproduce the call: kept for the later calls of this structure, unless a draw replayed
        # whole (one for the batch) may take another branch on another batch
        if examples >= 2 and not any(replayed_whole):
            call.confirmed = tuple(batched)
    return {key: Materialised(g.to(compute_dtype(values[key]))) for key, g in grads.items()}


def _batched_inputs(name: str, layer: nn.Module, call: CapturedCall, flat: list[Any], rows: int) -> list[int]:
    """The positions of the inputs to split by example: those confirmed for this structure of the call, or (before a
    confirmation) the tensors with ``rows`` rows.

    Raises:
        UnsupportedModuleError: a confirmed input no longer has ``rows`` rows.
    """
    if call.batched is None:
        return [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.ndim > 0 and x.shape[0] == rows]
    if any(flat[i].shape[0] != rows for i in call.batched):
        raise UnsupportedModuleError(
            f"module '{name}' ({type(layer).__name__}) was called with per-example inputs of another size than when "
            "the exact fallback checked it: its per-example inputs must have one row per example"
        )
    return list(call.batched)


def _check_rerun(
    name: str, layer: nn.Module, output: torch.Tensor, rerun: torch.Tensor, rtol: float | None = None
) -> None:
    """Raise when the examples rerun alone (``[B, r or 1, ...]``) differ from the call's output (``[B, r, ...]``)
    beyond rounding (``rtol``; by default the output dtype's)."""
    try:
        rerun = torch.broadcast_to(rerun, output.shape)
    except RuntimeError as error:
        raise _rerun_error(name, layer, error) from error
    scale = output.abs().max().clamp_min(torch.finfo(output.dtype).tiny)
    diff = (rerun.to(output.dtype) - output).abs().max()
    rtol = RERUN_RTOL.get(output.dtype, 1e-4) if rtol is None else rtol
    if not diff <= rtol * scale:  # also NaN
        kind = type(layer).__name__
        raise UnsupportedModuleError(
            f"module '{name}' ({kind}) is not per-sample: its output rerun on each row alone differs from its output "
            f"on the batch by {float(diff / scale):.3g} (relative; tolerance {rtol:g}), so row i depends on other "
            "rows (it mixes samples) or the forward is random; make it act on each sample separately, or "
            + _ROUTE.format(kind=kind)
        )


#: The fallback's family: assigned by validation to a module with trainable parameters and no family.
FALLBACK = LayerFamily(fallback_terms, captures_call=True, reruns=True)


def enclosing_family(encloses: tuple[str, ...]) -> LayerFamily:
    """The fallback for a module whose per-sample gradients also cover the own parameters of the descendants at
    ``encloses`` (paths relative to it): parameters read outside their module's forward, or used on rows that are not
    examples, served by the smallest enclosing module that is per-sample (:mod:`lightning_dp.checks.enclosing`)."""
    if not encloses:
        return FALLBACK
    terms: Callable[..., dict[str, Term]] = partial(fallback_terms, encloses=encloses)
    return LayerFamily(terms, captures_call=True, reruns=True, encloses=encloses)


def refuse_example_lists(name: str, layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a fallback-served module's call given a marked per-example list (:mod:`lightning_dp.data.example_lists`):
    its reruns cannot split it, and whole it carries the others' entries. Raises ``UnsupportedModuleError``."""
    if not any(_marked(value) for value in tree_leaves((args, kwargs), is_leaf=_marked)):
        return
    try:
        where = next(keystr(p) for p, v in tree_flatten_with_path((args, kwargs), is_leaf=_marked)[0] if _marked(v))
    except ValueError:  # a pytree type registered without keys
        where = "an argument"
    raise UnsupportedModuleError(
        f"module '{name}' ({type(layer).__name__}) is served by the exact fallback and was given a per-example list of "
        f"the batch ({where}), which its per-example reruns cannot split: keep such entries (a text column, names) out "
        "of the model's inputs (HF: remove_unused_columns=True), or pass them as a tensor with one row per example"
    )


def _marked(value: Any) -> bool:
    """A marked per-example sequence is one input of the call (refused by :func:`refuse_example_lists`)."""
    return isinstance(value, EXAMPLE_SEQUENCES)
