"""Subclasses of a supported layer whose ``forward`` wraps the parent's: HF's scaled word embeddings (Gemma, BART:
``super().forward(ids) * scale``), OPT's offset position embeddings (``super().forward(positions + 2)``), ConvNext's
channels-first LayerNorm (``permute``, ``super().forward``, ``permute``).

Such a module is swapped in place for a class whose parent call (``super().forward`` inside the subclass's forward)
runs a hooked proxy of the parent type over the module's own parameters, so the parent's family sees exactly the
parent's call and what the subclass does around it is ordinary autograd (docs/design.md section 4.2).
"""

from __future__ import annotations

from typing import Any, cast

from torch import nn

from lightning_dp.clipping.layers.registry import find_layer_family, registered_parent
from lightning_dp.clipping.swaps.base import Proxy, SwappedModule, register_swap_rule

#: The name of the proxy child that runs the parent's forward.
INNER = "dp_parent_call"

_PROXIES: dict[type[nn.Module], type[nn.Module]] = {}
_ROUTES: dict[type[nn.Module], type[nn.Module]] = {}
_SWAPPED: dict[type[nn.Module], type[SwappedModule]] = {}


def _proxy_class(parent: type[nn.Module]) -> type[nn.Module]:
    """``Shared<Parent>``: a :class:`Proxy` of the parent type (its forward is the parent's)."""
    if parent not in _PROXIES:
        _PROXIES[parent] = type(f"Shared{parent.__name__}", (Proxy, parent), {"__module__": __name__})
    return _PROXIES[parent]


def _route_class(parent: type[nn.Module]) -> type[nn.Module]:
    """A subclass of the parent whose ``forward`` calls the proxy child: what ``super().forward`` reaches."""

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return getattr(self, INNER)(*args, **kwargs)

    if parent not in _ROUTES:
        _ROUTES[parent] = type(f"RouteTo{parent.__name__}", (parent,), {"forward": forward, "__module__": __name__})
    return _ROUTES[parent]


def _calls_parent_forward(module_type: type[nn.Module]) -> bool:
    """Whether the subclass's own ``forward`` names ``super`` and ``forward`` (``super().forward(...)``)."""
    code = getattr(module_type.forward, "__code__", None)
    return code is not None and {"super", "forward"} <= set(code.co_names)


class ParentCallSwap(SwappedModule):
    """Mixin of the swapped classes: the proxy child over the module's own parameters and buffers (same objects)."""

    _dp_parent: type[nn.Module]

    def add_proxies(self) -> list[str]:
        """Add :data:`INNER`, a proxy of the parent type sharing this module's parameters, buffers and attributes."""
        proxy_type = _proxy_class(self._dp_parent)
        proxy = proxy_type.__new__(proxy_type)
        nn.Module.__init__(proxy)
        for key, value in vars(self).items():
            if not key.startswith("_"):  # the parent's configuration: in_features, padding_idx, eps, ...
                proxy.__dict__[key] = value
        proxy._parameters.update(self._parameters)
        proxy._buffers.update(self._buffers)
        self.add_module(INNER, proxy)
        return [INNER]


def parent_call_swap(module: nn.Module) -> type[SwappedModule] | None:
    """The swapped class for a module whose type subclasses a registered layer type, overrides its ``forward`` and
    calls the parent's from it; None for any other module."""
    module_type = type(module)
    parent = registered_parent(module_type)
    if parent is None or not _calls_parent_forward(module_type) or find_layer_family(module) is not None:
        return None
    if next(module.children(), None) is not None:
        return None
    if module_type not in _SWAPPED:
        namespace = {"_dp_parent": parent, "__module__": __name__}
        bases = (ParentCallSwap, module_type, _route_class(parent))
        _SWAPPED[module_type] = cast(type[SwappedModule], type(f"DP{module_type.__name__}", bases, namespace))
    return _SWAPPED[module_type]


register_swap_rule(parent_call_swap)
