"""The accountant protocol and the registry of accountants by name.

An accountant keeps a ledger of ``(event, count)`` entries (``compose``) and converts it to a privacy
guarantee (``get_epsilon(delta)``). Neighbouring datasets differ by adding or removing one example
(docs/design.md section 3.1). Subclasses implement ``supports`` and ``_epsilon``; the ledger, validation,
checkpoint state and the registry live here once.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar, overload

from lightning_dp.accounting.events import event_from_dict, event_to_dict
from lightning_dp.registration import Registry, class_decorator

#: The accountants by ``name`` (read it as a dict; add with :func:`register_accountant`, remove with ``remove``).
ACCOUNTANTS: Registry[str, type[Accountant]] = Registry("accountant")

_A = TypeVar("_A", bound="type[Accountant]")


@overload
def register_accountant(cls: _A, /, *, override: bool = False) -> _A: ...
@overload
def register_accountant(cls: None = None, /, *, override: bool = False) -> Callable[[_A], _A]: ...
def register_accountant(cls: _A | None = None, /, *, override: bool = False) -> _A | Callable[[_A], _A]:
    """Class decorator: make an accountant constructible by its ``name`` (for configs and the CLI). Use it bare
    (``@register_accountant``), or as ``@register_accountant(override=True)`` / ``register_accountant(cls,
    override=True)`` to replace the accountant registered under that name (logged as a warning). Registering the same
    class again does nothing.

    Raises:
        ValueError: another class is registered under ``cls.name`` and ``override`` is False.
    """
    return class_decorator(cls, lambda cls: ACCOUNTANTS.register(cls.name, cls, override=override))


def make_accountant(name: str) -> Accountant:
    """Build a registered accountant by name. Raises ``ValueError`` naming the valid choices."""
    return ACCOUNTANTS.get(name)()


def validate_delta(delta: float, name: str = "delta") -> None:
    """Raise ``ValueError`` unless ``0 < delta < 1``; the message calls it ``name`` (``target_delta`` for a
    configuration's)."""
    if not 0.0 < delta < 1.0:
        raise ValueError(f"{name} must lie in (0, 1), got {delta}; a typical choice is below 1/N for N examples")


def validate_epsilon(target_epsilon: float) -> None:
    """Raise ``ValueError`` unless the privacy budget ``target_epsilon > 0``."""
    if not target_epsilon > 0.0:
        raise ValueError(f"target_epsilon must be positive, got {target_epsilon}; a typical budget is 1 to 10")


class Accountant(ABC):
    """Composes privacy events and reports (epsilon, delta).

    Attributes:
        name: registry name (``make_accountant(name)``).
        ledger: list of ``[event, count]`` in the order composed; consecutive equal events are merged.
    """

    name: ClassVar[str]
    #: True when the accountant gives pure DP, so ``get_epsilon`` ignores delta.
    pure: ClassVar[bool] = False
    #: What a reader of ``lightning-dp epsilon``'s table must know about this bound ("" when nothing).
    note: ClassVar[str] = ""
    #: The legend label of its curve in ``--plot`` (``None``: the name), where the name alone would mislead.
    plot_label: ClassVar[str | None] = None

    def __init__(self) -> None:
        self.ledger: list[list[Any]] = []

    @abstractmethod
    def supports(self, event: Any) -> bool:
        """Whether this accountant can bound ``event``."""

    @abstractmethod
    def _epsilon(self, delta: float) -> float:
        """Epsilon of the whole ledger at ``delta`` (ledger is non-empty)."""

    def compose(self, event: Any, count: int = 1) -> Accountant:
        """Record ``count`` applications of ``event``. Raises ``ValueError`` if the event is unsupported."""
        if count < 0:
            raise ValueError(f"count must be non-negative, got {count}")
        if not self.supports(event):
            raise ValueError(f"Accountant {self.name!r} does not support {event!r}")
        if count == 0:
            return self
        if self.ledger and self.ledger[-1][0] == event:
            self.ledger[-1][1] += count
        else:
            self.ledger.append([event, count])
        return self

    @property
    def steps(self) -> int:
        """Total number of composed events."""
        return sum(count for _, count in self.ledger)

    def get_epsilon(self, delta: float) -> float:
        """Epsilon of all composed events at ``delta`` (0.0 for an empty ledger).

        Raises:
            ValueError: ``delta`` outside (0, 1) (pure-DP accountants accept any delta in [0, 1)).
        """
        if not (self.pure and 0.0 <= delta < 1.0):
            validate_delta(delta)
        if not self.ledger:
            return 0.0
        return float(self._epsilon(delta))

    def copy(self) -> Accountant:
        """An independent copy (e.g. to ask "what if I took k more steps")."""
        return copy.deepcopy(self)

    def state_dict(self) -> dict[str, Any]:
        """JSON-compatible state for checkpoints."""
        return {"name": self.name, "ledger": [[event_to_dict(e), c] for e, c in self.ledger]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the ledger saved by :meth:`state_dict`. Raises ``ValueError`` on an accountant mismatch."""
        if state["name"] != self.name:
            raise ValueError(f"State was saved by accountant {state['name']!r}, not {self.name!r}")
        self.ledger = [[event_from_dict(e), int(c)] for e, c in state["ledger"]]
