"""Registry of supported layer families, keyed by layer type (plus name-based rules for third-party classes).

A family maps ``(layer, activation, output_grad)`` (sample dimension first; plus the parameter values for a family
with ``reads_parameters``) to ``{param name: Term}``; a new layer is one file calling :func:`register_layer` or
:func:`register_layer_rule` (docs/design.md sections 4.2 and 10.1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from lightning_dp.clipping.terms import Term
from lightning_dp.registration import Registry, qualified_name

LayerTermsFn = Callable[..., dict[str, Term]]
#: ``(layer, generator) -> inputs``: a small input for the layer, drawn from ``generator`` (:func:`probed_family`).
LayerProbe = Callable[[Any, torch.Generator], tuple[torch.Tensor, ...]]
#: ``layer -> error message or None``; called with a module of the family's types (or matched by its rule).
LayerCheck = Callable[[Any], str | None]


class UnsupportedModuleError(ValueError):
    """A module or parameter that per-sample clipping cannot handle (raised before training starts)."""


class MisplacedParametersError(UnsupportedModuleError):
    """Parameters whose gradient the hooks cannot attribute to examples where their module runs: read outside their
    module's forward, or used by a layer on rows that are not examples (``[1, ...]`` positions shared by the batch).

    The attach probe serves them by the exact fallback on the smallest enclosing module that is per-sample
    (:mod:`lightning_dp.checks.enclosing`); raised as is where it cannot.

    Attributes:
        parameters: the names of the parameters read outside their module's forward.
        modules: the paths of the modules whose calls had rows that are not examples.
    """

    def __init__(self, message: str, *, parameters: tuple[str, ...] = (), modules: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.parameters = parameters
        self.modules = modules


@dataclass(frozen=True)
class LayerFamily:
    """How one family of layers yields per-sample gradient terms.

    Attributes:
        terms: ``(layer, activation, output_grad) -> {param name: Term}`` for the layer's trainable parameters.
        expand_batch: expand a first input with batch dimension 1 (``position_ids`` ``[1, T]``) to the batch size.
        check: ``layer -> error message or None``, for configurations of a supported type that mix samples.
        reads_parameters: names of parameters whose values ``terms`` reads; when not empty ``terms`` takes a fourth
            argument ``{name: value}``, the values copied when the call ran.
        captures_call: the family needs every input of the call, not the first alone (the exact fallback,
            :mod:`~lightning_dp.clipping.layers.fallback`); ``terms`` is then ``(path, layer, call, output_grad,
            {name: value}, rows_per_example) -> {param name: Term}``, the terms per example (rows folded).
        probe: a small input for the type (:func:`probed_family`), or None.
        output_index: for a forward returning a tuple, the element whose gradient the terms take (a router's logits).
        reruns: the family reruns the module's forward per example and compares it with the call's output (the exact
            fallback): its output may be any structure of tensors, all with the call's rows.
        encloses: paths (relative to the module) of descendant modules whose own parameters the terms also cover (an
            enclosing fallback, :func:`~lightning_dp.clipping.layers.fallback.enclosing_family`); those are not
            hooked.
    """

    terms: LayerTermsFn
    expand_batch: bool = False
    check: LayerCheck | None = None
    reads_parameters: tuple[str, ...] = ()
    captures_call: bool = False
    probe: LayerProbe | None = None
    output_index: int | None = None
    reruns: bool = False
    encloses: tuple[str, ...] = ()


def _describe_family(family: LayerFamily) -> str:
    return qualified_name(family.terms)


#: The layer families by exact layer type (add with :func:`register_layer`, remove with ``remove``).
_BY_TYPE: Registry[type[nn.Module], LayerFamily] = Registry(
    "layer type", describe=_describe_family, alternative="register it for a subclass instead"
)
#: The rules and their families, in registration order, keyed by the rule's :func:`qualified_name` (add with
#: :func:`register_layer_rule`, remove with ``remove``).
_BY_RULE: Registry[str, tuple[Callable[[nn.Module], bool], LayerFamily]] = Registry(
    "layer rule", describe=lambda entry: _describe_family(entry[1]), alternative="give the rule another name"
)


def register_layer(
    *types: type[nn.Module],
    expand_batch: bool = False,
    check: LayerCheck | None = None,
    reads_parameters: tuple[str, ...] = (),
    captures_call: bool = False,
    probe: LayerProbe | None = None,
    override: bool = False,
) -> Callable[[LayerTermsFn], LayerTermsFn]:
    """Decorator registering a layer-terms function for the given layer types (:class:`LayerFamily`); all types or none.
    The same family again does nothing; replacing another needs ``override=True`` (logged).

    Raises:
        ValueError: a type already has another family and ``override`` is False.
    """

    def decorate(fn: LayerTermsFn) -> LayerTermsFn:
        family = LayerFamily(fn, expand_batch, check, reads_parameters, captures_call, probe)
        _BY_TYPE.register_many(dict.fromkeys(types, family), override=override)
        return fn

    return decorate


def register_layer_rule(
    rule: Callable[[nn.Module], bool],
    *,
    check: LayerCheck | None = None,
    captures_call: bool = False,
    output_index: int | None = None,
    override: bool = False,
) -> Callable[[LayerTermsFn], LayerTermsFn]:
    """Decorator registering a layer-terms function for every module with ``rule(module)`` True, keyed by ``rule``'s
    qualified name; replacing another family needs ``override=True`` (logged; the rule keeps its place).

    Raises:
        ValueError: a rule of that qualified name has another family and ``override`` is False.
    """

    def decorate(fn: LayerTermsFn) -> LayerTermsFn:
        family = LayerFamily(fn, check=check, captures_call=captures_call, output_index=output_index)
        _BY_RULE.register(qualified_name(rule), (rule, family), override=override)
        return fn

    return decorate


def find_layer_family(module: nn.Module) -> LayerFamily | None:
    """The family of ``module``, or None: the exact type, then a registered base class whose ``forward`` the subclass
    does not override, then the rules in registration order.
    """
    module_type = type(module)
    if module_type in _BY_TYPE:
        return _BY_TYPE[module_type]
    for base in module_type.__mro__[1:]:
        if base in _BY_TYPE and module_type.forward is cast(type[nn.Module], base).forward:  # keys are module types
            return _BY_TYPE[base]
    for rule, family in _BY_RULE.values():
        if rule(module):
            return family
    return None


def registered_parent(module_type: type[nn.Module]) -> type[nn.Module] | None:
    """The nearest base class of ``module_type`` registered by type whose ``forward`` ``module_type`` overrides, or
    None (``module_type`` itself registered, or no such base)."""
    if module_type in _BY_TYPE:
        return None
    for base in module_type.__mro__[1:]:
        if base in _BY_TYPE:
            registered = cast(type[nn.Module], base)  # keys are module types
            return registered if module_type.forward is not registered.forward else None
    return None


def probe_generator(params: list[torch.Tensor]) -> torch.Generator | None:
    """A dedicated generator, seeded, on the parameters' device for a probe input; None when there is no parameter or
    one cannot be probed (on the meta device, or an FSDP2-sharded ``DTensor``)."""
    if not params or any(p.is_meta or type(p.data) is not torch.Tensor for p in params):
        return None
    return torch.Generator(params[0].device).manual_seed(0)


def probed_family(module: nn.Module) -> LayerFamily | None:
    """The family of ``module``'s registered parent type when ``module`` overrides the parent's ``forward`` with the
    same function (HF ``FalconLinear``: ``x @ W.T + b``), or None.

    Both forwards run on the parent family's probe input (a dedicated generator, no grad, no hooks) and must agree to
    rounding; parameters on the meta device or sharded (FSDP2 ``DTensor``) are not probed.
    """
    parent = registered_parent(type(module))
    family = None if parent is None else _BY_TYPE[parent]
    if parent is None or family is None or family.probe is None:
        return None
    generator = probe_generator(list(module.parameters(recurse=False)))
    if generator is None:
        return None
    try:
        with torch.no_grad():
            inputs = family.probe(module, generator)
            own, reference = type(module).forward(module, *inputs), parent.forward(module, *inputs)
    except Exception:  # a forward that needs other inputs is not the parent's
        return None
    same = (
        isinstance(own, torch.Tensor)
        and own.shape == reference.shape
        and torch.allclose(own, reference, rtol=1e-4, atol=1e-5 * float(reference.abs().max().clamp_min(1)))
    )
    return family if same else None
