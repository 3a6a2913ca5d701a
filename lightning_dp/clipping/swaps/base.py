"""Weight-preserving, in-place swaps of modules that use their parameters outside any hookable layer call.

Each registered module (:func:`register_swap`) becomes, in place, an equivalent subclass whose ``forward`` routes
every parameter use through *proxy* children that register the module's own parameter objects; parameter objects,
names, ``state_dict`` and ``isinstance`` are unchanged, and :func:`restore_modules` undoes it (docs/design.md
sections 4.1 and 10.1).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from torch import nn

from lightning_dp.clipping.layers.registry import UnsupportedModuleError
from lightning_dp.registration import Registry, qualified_name

log = logging.getLogger("lightning_dp")


class Proxy(nn.Module):
    """Base of proxy modules: they register another module's parameters and save or load nothing."""

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        """Save nothing: the owner saves these parameters under its own keys."""

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Load nothing (and report no missing key): the owner loads these parameters."""


class SharedLinear(Proxy, nn.Linear):
    """A :class:`Proxy` ``nn.Linear`` over another module's ``weight`` ``[d_out, d_in]`` and ``bias`` ``[d_out]`` (or
    None)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = weight
        self.bias = bias  # type: ignore[assignment]  # None: no bias, as in nn.Linear(bias=False)


class SwappedModule(nn.Module):
    """Base of the swapped classes (listed before the original type in the bases).

    Subclasses implement :meth:`add_proxies` (must not fail; :meth:`swap_problem` reports what it cannot handle) and a
    ``forward`` computing the original function with every trainable parameter use through a proxy or hooked child.
    """

    @classmethod
    def swap_problem(cls, module: nn.Module) -> str | None:
        """Why ``module`` (of the original type) cannot be swapped, or None."""
        return None

    def add_proxies(self) -> list[str]:
        """Add the proxy children (``self.add_module``); return their names."""
        raise NotImplementedError


#: The swaps by original type or qualified class name (add with :func:`register_swap`, remove with ``remove``).
_SWAPS: Registry[type[nn.Module] | str, type[SwappedModule]] = Registry(
    "module swap", alternative="register it for a subclass instead"
)
_DYNAMIC: dict[tuple[type[SwappedModule], type[nn.Module]], type[SwappedModule]] = {}


def register_swap(
    original: type[nn.Module] | str, *, override: bool = False
) -> Callable[[type[SwappedModule]], type[SwappedModule]]:
    """Class decorator registering a swap for modules of exactly the type ``original``.

    ``original`` is a class (which the decorated class subclasses) or the qualified name of an optional dependency's
    class (the decorated class is then a mixin; nothing is imported). Re-registering the same class does nothing;
    replacing another swap of ``original``, keyed by class or by name, needs ``override=True`` (logged).

    Raises:
        TypeError: ``original`` is a class the decorated class does not subclass.
        ValueError: another swap is registered for ``original`` and ``override`` is False.
    """

    def decorate(cls: type[SwappedModule]) -> type[SwappedModule]:
        if isinstance(original, type) and not issubclass(cls, original):
            raise TypeError(f"{cls.__name__} must subclass {original.__name__}")
        aliases = [key for key in _aliases(original) if _SWAPS[key] is not cls]
        if aliases and not override:
            raise ValueError(
                f"module swap {_SWAPS.label(aliases[0])} is already registered for the same class "
                f"({qualified_name(_SWAPS[aliases[0]])}); pass override=True to replace it, or register it for a "
                "subclass instead"
            )
        _SWAPS.register(original, cls, override=override)
        for key in aliases:
            log.warning(
                "module swap %s (registered by %s): %s replaced by %s, registered by %s (override=True)",
                _SWAPS.label(key),
                _key_kind(key),
                qualified_name(_SWAPS.remove(key)),
                qualified_name(cls),
                _key_kind(original),
            )
        return cls

    return decorate


def _key_kind(key: type[nn.Module] | str) -> str:
    return "class" if isinstance(key, type) else "qualified name"


def _aliases(original: type[nn.Module] | str) -> list[type[nn.Module] | str]:
    """The other keys of :data:`_SWAPS` naming the same class as ``original`` (by name or by class)."""
    if isinstance(original, type):
        name = qualified_name(original)
        return [name] if name in _SWAPS else []
    return [key for key in _SWAPS if isinstance(key, type) and qualified_name(key) == original]


#: ``module -> swapped class or None``, consulted in order for a module of no registered swap type.
SwapRule = Callable[[nn.Module], "type[SwappedModule] | None"]
_RULES: list[SwapRule] = []


def register_swap_rule(rule: SwapRule) -> SwapRule:
    """Add a rule giving the swapped class of modules no registered type covers (once; returns ``rule``)."""
    if rule not in _RULES:
        _RULES.append(rule)
    return rule


def _swapped_class(module: nn.Module) -> type[SwappedModule] | None:
    """The swapped class for ``module``'s exact type, or the first rule's, or None."""
    module_type = type(module)
    if module_type in _SWAPS:
        return _SWAPS[module_type]
    name = qualified_name(module_type)
    if name not in _SWAPS:
        return next((cls for rule in _RULES if (cls := rule(module)) is not None), None)
    return mixed_class(_SWAPS[name], module_type)


def mixed_class(mixin: type[SwappedModule], module_type: type[nn.Module]) -> type[SwappedModule]:
    """The swapped class ``DP<Name>(mixin, module_type)``, made once per pair."""
    key = (mixin, module_type)
    if key not in _DYNAMIC:
        namespace = {"__module__": mixin.__module__}
        _DYNAMIC[key] = cast(type[SwappedModule], type(f"DP{module_type.__name__}", (mixin, module_type), namespace))
    return _DYNAMIC[key]


@dataclass(frozen=True)
class Swap:
    """One swapped module: the module, its original class and the names of the proxies added to it."""

    module: nn.Module
    original: type[nn.Module]
    proxies: tuple[str, ...]


def swap_modules(module: nn.Module) -> list[Swap]:
    """Swap in place every submodule (``module`` included) of a registered type with a trainable parameter.

    Returns:
        The swaps, for :func:`restore_modules`.

    Raises:
        UnsupportedModuleError: a configuration its swap does not support (nothing is left swapped).
    """
    swaps: list[Swap] = []
    try:
        for path, sub in list(module.named_modules()):
            cls = _swapped_class(sub)
            if cls is None or not any(p.requires_grad for p in sub.parameters()):
                continue
            problem = cls.swap_problem(sub)
            if problem is not None:
                raise UnsupportedModuleError(f"module '{path or '<root>'}' ({type(sub).__name__}): {problem}")
            original = type(sub)
            sub.__class__ = cls
            swaps.append(Swap(sub, original, tuple(sub.add_proxies())))
    except BaseException:
        restore_modules(swaps)
        raise
    return swaps


def restore_modules(swaps: list[Swap]) -> None:
    """Undo :func:`swap_modules`: remove the proxies and restore the original classes (in reverse order)."""
    for swap in reversed(swaps):
        for name in swap.proxies:
            delattr(swap.module, name)
        swap.module.__class__ = swap.original
