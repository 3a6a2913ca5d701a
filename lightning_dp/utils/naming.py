"""Suggestions for misspelt names (noise mechanisms, accountants, clipping engines, CLI choices)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(name: object, valid: Iterable[str]) -> str | None:
    """The valid name closest to ``name`` (``difflib``, similarity >= 0.6, case-insensitive), or ``None``."""
    close = difflib.get_close_matches(str(name).lower(), list(valid), n=1)
    return close[0] if close else None


def did_you_mean(name: object, valid: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the :func:`closest` valid name, else ``""``.

    Meant to follow the name in an error message, e.g. ``f"Unknown noise {name!r}{did_you_mean(name, names)}"``.
    """
    close = closest(name, valid)
    return f" (did you mean {close!r}?)" if close else ""


def unknown_name(kind: str, name: object, valid: Iterable[str]) -> str:
    """The message for an unknown registry name, e.g. ``Unknown noise 'gausian' (did you mean 'gaussian'?);
    choose one of [...]``."""
    names = sorted(valid)
    return f"Unknown {kind} {name!r}{did_you_mean(name, names)}; choose one of {names}"
