"""Privacy events: plain-data descriptions of what one training step releases.

Mechanisms emit events, accountants compose them (the protocol of Google's ``dp_accounting``:
``GaussianDpEvent``, ``PoissonSampledDpEvent``, ``SelfComposedDpEvent``). Keeping the ledger as data makes it
easy to log, checkpoint (``event_to_dict`` / ``event_from_dict``) and recompute with another accountant.

Every event class is a frozen dataclass registered under a type name, so ``event_from_dict`` can rebuild it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar, overload

from lightning_dp.registration import Registry, class_decorator

#: The event classes by class name (add with :func:`register_event`, remove with ``remove``).
_EVENT_TYPES: Registry[str, type] = Registry("privacy event", alternative="rename the class")

_E = TypeVar("_E", bound=type)


@overload
def register_event(cls: _E, /, *, override: bool = False) -> _E: ...
@overload
def register_event(cls: None = None, /, *, override: bool = False) -> Callable[[_E], _E]: ...
def register_event(cls: _E | None = None, /, *, override: bool = False) -> _E | Callable[[_E], _E]:
    """Class decorator: register a frozen dataclass event under its class name for (de)serialisation. Use it bare
    (``@register_event``), or as ``@register_event(override=True)`` / ``register_event(cls, override=True)`` to
    replace the class registered under that name (logged as a warning). Registering the same class again does nothing.

    Raises:
        ValueError: another class is registered under ``cls.__name__`` and ``override`` is False.
    """
    return class_decorator(cls, lambda cls: _EVENT_TYPES.register(cls.__name__, cls, override=override))


@register_event
@dataclasses.dataclass(frozen=True)
class GaussianEvent:
    """Gaussian mechanism ``N(0, (noise_multiplier * C)^2 I)`` on an l2-clipped sum (sensitivity C)."""

    noise_multiplier: float


@register_event
@dataclasses.dataclass(frozen=True)
class LaplaceEvent:
    """Traditional Laplace: i.i.d. ``Lap(0, noise_scale)`` per coordinate on an l1-clipped sum.

    The l1 sensitivity is ``max_grad_norm``, so one step is ``max_grad_norm / noise_scale``-DP (pure).
    """

    noise_scale: float
    max_grad_norm: float


@register_event
@dataclasses.dataclass(frozen=True)
class Lap2Event:
    """i.i.d. ``Lap(0, noise_scale)`` per coordinate on an l2-clipped sum over ``num_params`` coordinates.

    Released by the ``lap2`` and ``laplace-advanced`` mechanisms (LAP2 seed, Alg. 1; literature review 4.4).
    """

    noise_scale: float
    max_grad_norm: float
    num_params: int


@register_event
@dataclasses.dataclass(frozen=True)
class PlrvEvent:
    """PLRV-O: per coordinate ``u ~ Gamma(gamma_shape, gamma_scale)`` then ``Lap(0, 1/u)``, l2-clipped sum.

    PLRV-O seed, Def. 4.10 / Alg. 1; ``max_grad_norm`` enters only the accountant (Thm 4.8, 4.9).
    """

    gamma_shape: float
    gamma_scale: float
    max_grad_norm: float
    num_params: int


@register_event
@dataclasses.dataclass(frozen=True)
class RandomizedClippingGaussianEvent:
    """Gaussian ``N(0, (noise_multiplier * C)^2 I)`` on a sum clipped with ESTIMATED per-sample norms.

    The norms come from Hutchinson's (``estimator="hutch"``) or Hutch++ (``"hutchpp"``) trace estimator with
    ``projection_dim`` (k) Gaussian columns, on layers whose unprojected dimension is at most ``norm_dim`` (d);
    seed ``dpsgd-rc``, Alg. 1-2, Thm 5.1. Accounted by the ``rc`` accountant.
    """

    noise_multiplier: float
    projection_dim: int
    norm_dim: int
    estimator: str = "hutch"


@register_event
@dataclasses.dataclass(frozen=True)
class PoissonSampledEvent:
    """``event`` applied to a Poisson subsample where each record is included with ``sample_rate``."""

    sample_rate: float
    event: Any


def event_to_dict(event: Any) -> dict[str, Any]:
    """Serialise a registered event (recursively) to JSON-compatible data."""
    name = type(event).__name__
    if name not in _EVENT_TYPES:
        raise TypeError(f"{name} is not a registered privacy event; decorate it with @register_event")
    out: dict[str, Any] = {"type": name}
    for field in dataclasses.fields(event):
        value = getattr(event, field.name)
        out[field.name] = event_to_dict(value) if type(value).__name__ in _EVENT_TYPES else value
    return out


def event_from_dict(data: dict[str, Any]) -> Any:
    """Inverse of :func:`event_to_dict`. Raises ``ValueError`` for an unknown event type."""
    data = dict(data)
    cls = _EVENT_TYPES.get(data.pop("type"))
    kwargs = {k: event_from_dict(v) if isinstance(v, dict) and "type" in v else v for k, v in data.items()}
    return cls(**kwargs)
