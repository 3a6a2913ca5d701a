"""The registry type behind every extension point: a dict that refuses to replace an entry unless asked to
(docs/design.md section 10). Standard library only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar, overload

from lightning_dp.utils.naming import unknown_name

log = logging.getLogger("lightning_dp")

K = TypeVar("K")
V = TypeVar("V")
C = TypeVar("C")
D = TypeVar("D")


def qualified_name(obj: Any) -> str:
    """``module.qualname`` of a class or function (``lightning_dp.mechanisms.gaussian.GaussianMechanism``); the
    ``repr`` of anything else."""
    name = getattr(obj, "__qualname__", None)
    return f"{obj.__module__}.{name}" if isinstance(name, str) else repr(obj)


_MISSING: Any = object()


class Registry(dict[K, V], Generic[K, V]):
    """Named entries of one kind, read as a dict and written only through :meth:`register` / :meth:`remove`.

    Args:
        kind: what an entry is, for messages (``"mechanism"``, ``"layer type"``).
        option: the option an entry's name is given to, for unknown-name messages (default ``kind``).
        describe: the text naming an entry's value in messages (default :func:`qualified_name`).
        alternative: the way out, other than ``override=True``, that a refusal suggests.
    """

    def __init__(
        self,
        kind: str,
        *,
        option: str | None = None,
        describe: Callable[[V], str] = qualified_name,
        alternative: str = "choose another name",
    ) -> None:
        super().__init__()
        self.kind = kind
        self.option = kind if option is None else option
        self.describe = describe
        self.alternative = alternative

    @overload  # type: ignore[override]  # dict.get returns None for a missing key; this one raises
    def get(self, key: K) -> V: ...
    @overload
    def get(self, key: K, default: D) -> V | D: ...
    def get(self, key: K, default: Any = _MISSING) -> Any:
        """The value under ``key``; ``default`` when given and nothing is registered.

        Raises:
            ValueError: unknown ``key`` and no ``default`` (suggesting the closest name and listing the registered
                ones).
        """
        if key in self:
            return self[key]
        if default is _MISSING:
            raise ValueError(unknown_name(self.option, key, self.names()))
        return default

    def names(self) -> list[str]:
        """The registered keys as messages show them, sorted (a class by its qualified name)."""
        return sorted(qualified_name(key) if isinstance(key, type) else str(key) for key in self)

    def label(self, key: K) -> str:
        """``key`` as messages quote it: a class by its qualified name, anything else by its ``repr``."""
        return repr(qualified_name(key)) if isinstance(key, type) else repr(key)

    def register(self, key: K, value: V, *, override: bool = False) -> None:
        """Add ``value`` under ``key``; an equal value again does nothing; replacing another needs ``override=True``
        (logged).

        Raises:
            ValueError: ``key`` holds another value and ``override`` is False.
        """
        self.register_many({key: value}, override=override)

    def register_many(self, entries: Mapping[K, V], *, override: bool = False) -> None:
        """:meth:`register` each of ``entries``, all or none.

        Raises:
            ValueError: a key holds another value and ``override`` is False (naming the first).
        """
        new = {key: value for key, value in entries.items() if key not in self or not _same(self[key], value)}
        replaced = [key for key in new if key in self]
        if replaced and not override:
            key = replaced[0]
            raise ValueError(
                f"{self.kind} {self.label(key)} is already registered ({self.describe(self[key])}); "
                f"pass override=True to replace it, or {self.alternative}"
            )
        for key in replaced:
            old, value = self.describe(self[key]), self.describe(new[key])
            log.warning("%s %s: %s replaced by %s (override=True)", self.kind, self.label(key), old, value)
        dict.update(self, new)

    def remove(self, key: K) -> V:
        """Remove the entry under ``key`` and return its value.

        Raises:
            KeyError: nothing is registered under ``key``.
        """
        if key not in self:
            raise KeyError(f"{self.kind} {self.label(key)} is not registered")
        return dict.pop(self, key)

    def _refuse(self, *args: object, **kwargs: object) -> None:
        raise TypeError(
            f"the {self.kind} registry is read-only as a dict: add or replace entries with its register function "
            "(override=True to replace one), remove them with remove"
        )

    __setitem__ = __delitem__ = update = setdefault = pop = popitem = clear = __ior__ = _refuse  # type: ignore[assignment]


def _same(old: object, new: object) -> bool:
    return old is new or old == new


def class_decorator(cls: C | None, register: Callable[[C], object]) -> C | Callable[[C], C]:
    """``register(cls)`` and ``cls`` when ``cls`` is given, else the decorator doing so
    (``@register_x(override=True)``)."""

    def decorate(cls: C) -> C:
        register(cls)
        return cls

    return decorate if cls is None else decorate(cls)
