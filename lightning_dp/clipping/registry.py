"""Registry of supported layer families, keyed by layer type (plus name-based rules for third-party classes).

A layer family is a function ``(layer, activation, output_grad) -> {param name: Term}``; ``activation`` is the
layer's first input as captured in the forward pass and ``output_grad`` the gradient of ``sum_i loss_i`` w.r.t.
the layer output, both with the sample dimension first. A family whose terms depend on parameters' values (not only
on the captured tensors) names them in ``reads_parameters`` and gets a fourth argument, their values as the call used
them. Supporting a new layer is one new file that calls
:func:`register_layer` (or :func:`register_layer_rule`), plus its test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from lightning_dp.clipping.terms import Term

LayerTermsFn = Callable[..., dict[str, Term]]


class UnsupportedModuleError(ValueError):
    """A module or parameter that per-sample clipping cannot handle (raised before training starts)."""


@dataclass(frozen=True)
class LayerFamily:
    """How one family of layers yields per-sample gradient terms.

    Attributes:
        terms: ``(layer, activation, output_grad) -> {param name: Term}`` for the layer's trainable parameters.
        expand_batch: if True, a first input with batch dimension 1 is expanded to the batch size of the current
            forward pass before the layer runs (broadcast ``position_ids`` of shape ``[1, T]``), so that the
            output gradient keeps one row per sample.
        check: ``layer -> error message or None``, for configurations of a supported type that mix samples.
        reads_parameters: names of the layer's parameters whose values ``terms`` reads; when not empty, ``terms``
            takes a fourth argument, ``{name: value}``, the values the call used, copied when the call ran (the
            layer's parameters may have changed by the time the terms are built: per-sample momentum's past
            iterates, FSDP2's resharding).
    """

    terms: LayerTermsFn
    expand_batch: bool = False
    check: Callable[[nn.Module], str | None] | None = None
    reads_parameters: tuple[str, ...] = ()


_BY_TYPE: dict[type[nn.Module], LayerFamily] = {}
_BY_RULE: list[tuple[Callable[[nn.Module], bool], LayerFamily]] = []


def register_layer(
    *types: type[nn.Module],
    expand_batch: bool = False,
    check: Callable[[nn.Module], str | None] | None = None,
    reads_parameters: tuple[str, ...] = (),
) -> Callable[[LayerTermsFn], LayerTermsFn]:
    """Decorator registering a layer-terms function for the given layer types (see :class:`LayerFamily`)."""

    def decorate(fn: LayerTermsFn) -> LayerTermsFn:
        for layer_type in types:
            _BY_TYPE[layer_type] = LayerFamily(fn, expand_batch, check, reads_parameters)
        return fn

    return decorate


def register_layer_rule(
    rule: Callable[[nn.Module], bool], *, check: Callable[[nn.Module], str | None] | None = None
) -> Callable[[LayerTermsFn], LayerTermsFn]:
    """Decorator registering a layer-terms function for every module for which ``rule(module)`` is True
    (``check`` as in :class:`LayerFamily`)."""

    def decorate(fn: LayerTermsFn) -> LayerTermsFn:
        _BY_RULE.append((rule, LayerFamily(fn, check=check)))
        return fn

    return decorate


def find_layer_family(module: nn.Module) -> LayerFamily | None:
    """The family of ``module``, or None when unsupported.

    Lookup order: the exact type; a registered base class, provided the subclass does not override ``forward``
    (e.g. ``NonDynamicallyQuantizableLinear``); then the registered rules in registration order.
    """
    module_type = type(module)
    if module_type in _BY_TYPE:
        return _BY_TYPE[module_type]
    for base in module_type.__mro__[1:]:
        if base in _BY_TYPE and module_type.forward is base.forward:
            return _BY_TYPE[base]
    for rule, family in _BY_RULE:
        if rule(module):
            return family
    return None
