"""How :class:`~lightning_dp.config.privacy_config.PrivacyConfig`'s options reach the adapters: names, ``Args:`` text,
keyword-only parameters, removal from a strategy's keyword arguments, and removed options.
"""

from __future__ import annotations

import inspect
import textwrap
import typing
from dataclasses import fields
from typing import Any

from lightning_dp.config.privacy_config import PrivacyConfig


def option_docs(names: dict[str, str] | None = None, indent: int = 12) -> str:
    """The ``Args:`` entries of every option (Google style, each entry indented by ``indent`` spaces and its
    continuation lines by 4 more), the option names renamed by ``names`` (e.g. :data:`HF_NAMES`)."""
    names = names or {}
    lines = []
    for f in fields(PrivacyConfig):
        entry = f"{names.get(f.name, f.name)}: {f.metadata['doc']}"
        lines.extend(
            textwrap.wrap(entry, 120 - indent, initial_indent=" " * indent, subsequent_indent=" " * (indent + 4))
        )
    return "\n".join(lines)


#: the option names, in declaration order.
OPTION_NAMES: tuple[str, ...] = tuple(f.name for f in fields(PrivacyConfig))
#: Options that were removed, and what to do instead (a saved config may still name them).
REMOVED_OPTIONS: dict[str, str] = {
    "bookkeeping": "removed (the clipped sum is always formed by book-keeping, docs/design.md section 4.4): delete it",
}


def refuse_removed_options(names: typing.Iterable[str]) -> None:
    """Raise ``ValueError`` naming the first of ``names`` that is a removed option and what to do instead."""
    for name in names:
        if name in REMOVED_OPTIONS:
            raise ValueError(f"option {name!r} was {REMOVED_OPTIONS[name]}")


def pop_options(kwargs: dict[str, Any]) -> PrivacyConfig:
    """Remove the option names from ``kwargs`` (in place) and return the :class:`PrivacyConfig` they make.

    Raises:
        ValueError: as :class:`PrivacyConfig`, or a removed option (:data:`REMOVED_OPTIONS`).
    """
    refuse_removed_options(kwargs)
    return PrivacyConfig(**{name: kwargs.pop(name) for name in OPTION_NAMES if name in kwargs})


def option_parameters() -> list[inspect.Parameter]:
    """Keyword-only :class:`inspect.Parameter` of every option (name, default, annotation), for the signatures of
    the strategies that take the options as keyword arguments."""
    hints = typing.get_type_hints(PrivacyConfig)
    return [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
        for f in fields(PrivacyConfig)
    ]
