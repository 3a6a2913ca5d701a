"""Weight-preserving, in-place swaps of modules that use their parameters outside any hookable layer call.

Some standard modules compute with their parameters functionally (``nn.MultiheadAttention`` passes its packed
``in_proj_weight`` and ``out_proj.weight`` to ``F.multi_head_attention_forward``; ``nn.LSTM`` runs a fused kernel),
so no hooked layer sees those uses. When the clipper attaches, each such module (exact type registered with
:func:`register_swap`) is changed IN PLACE into an equivalent subclass (``module.__class__ = Swapped``) whose
``forward`` computes the same function through *proxy* children: :class:`SharedLinear` modules (and other small
registered layers) that register the module's OWN ``nn.Parameter`` objects, as tied weights do. Hence:

- the module object, its parameter objects and their names (``named_parameters()`` deduplicates shared parameters,
  the owner coming first) are unchanged, so an optimizer built before attaching keeps working;
- ``state_dict`` keys and values are unchanged: proxies save and load nothing;
- ``isinstance(module, nn.MultiheadAttention)`` still holds; the outputs are equal up to floating-point rounding;
- :func:`restore_modules` (called by the clipper's ``detach``) removes the proxies and restores the class.

Opacus instead replaces such modules by new ones with new parameters (``DPMultiheadAttention``, ``DPLSTM``), which
breaks optimizers built before and renames ``state_dict`` keys; the in-place swap avoids both.
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
    """Base of proxy modules: they register parameters owned by another module (the same objects, not copies), so
    they add nothing to ``state_dict`` and load nothing (the owner saves and loads the parameters)."""

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        """Save nothing: the owner saves these parameters under its own keys."""

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Load nothing (and report no missing key): the owner loads these parameters."""


class SharedLinear(Proxy, nn.Linear):
    """A :class:`Proxy` ``nn.Linear`` over another module's ``weight`` ``[d_out, d_in]`` and ``bias`` ``[d_out]``
    (or None); hooked as an ``nn.Linear`` (its ``forward`` is Linear's)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = weight
        self.bias = bias  # type: ignore[assignment]  # None: no bias, as in nn.Linear(bias=False)


class SwappedModule(nn.Module):
    """Base of the swapped classes, which subclass the original type and this class (a base defining ``forward``
    must come before the original type in the bases).

    Subclasses implement :meth:`add_proxies` (which must not fail: configurations it cannot handle are reported by
    :meth:`swap_problem`); their ``forward`` must compute the original function, every use of a trainable parameter
    going through a proxy (or an already hooked child).
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

    ``original`` is either a class, which the decorated class must subclass, or the qualified name of a class of
    an optional dependency (``"torchvision.models.vision_transformer.Encoder"``; nothing is imported): the decorated
    class is then a mixin, combined with the module's class when a module of that name is swapped. Registering the
    same class again does nothing; replacing another swap of ``original`` needs ``override=True`` (logged as a
    warning), also when that swap is keyed the other way (by the class where ``original`` is its name, or by the
    name where it is the class): the replaced one is then removed, so the new one is the one used.

    Raises:
        TypeError: ``original`` is a class and the decorated class does not subclass it.
        ValueError: another swap is registered for ``original`` (by class or by name) and ``override`` is False.
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
    """The keys of :data:`_SWAPS` other than ``original`` that name the same class: its qualified name for a class,
    the registered classes of that qualified name for a name."""
    if isinstance(original, type):
        name = qualified_name(original)
        return [name] if name in _SWAPS else []
    return [key for key in _SWAPS if isinstance(key, type) and qualified_name(key) == original]


def _swapped_class(module: nn.Module) -> type[SwappedModule] | None:
    """The swapped class for ``module``'s exact type, or None."""
    module_type = type(module)
    if module_type in _SWAPS:
        return _SWAPS[module_type]
    name = qualified_name(module_type)
    if name not in _SWAPS:
        return None
    mixin = _SWAPS[name]
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
        UnsupportedModuleError: a module of a registered type in a configuration its swap does not support (then
            nothing is left swapped).
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
