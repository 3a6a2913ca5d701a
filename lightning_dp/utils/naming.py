"""Suggestions for misspelt names (noise mechanisms, accountants, clipping engines, CLI choices), and how an entry
point names options in its messages (:class:`Naming`)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field


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


#: the quotes of a string value, dropped when it becomes a flag's value
_QUOTES = "'\""
#: a value written after ``name=`` in a message: a quoted string, a list, or a number / word (``1.5``, ``None``).
_VALUE = r"'[^']*'|\"[^\"]*\"|\[[^\]]*\]|[\w.+-]+"


@dataclass(frozen=True)
class Naming:
    """How one entry point names options: ``names`` maps the name a message uses (a ``PrivacyConfig`` field, or a
    validator's parameter such as ``delta``) to the user's; ``flags`` writes a setting ``name=value`` as the flag and
    its value (``--accountant rdp``) instead of Python's ``name=value``. A name with an underscore is renamed
    wherever it stands; a one-word name (``noise``, ``delta``) only in a setting or at the start of the message
    (``delta must lie in ...``), elsewhere it is read as an English word.

    Attributes:
        names: message name -> user's name (``{"max_grad_norm": "per_sample_max_grad_norm"}``; ``--max-grad-norm``
            on a command line). A name not in it is left as it is.
        flags: settings are written as command-line flags.
    """

    names: Mapping[str, str]
    flags: bool = False
    _pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        alternatives = "|".join(re.escape(name) for name in sorted(self.names, key=len, reverse=True))
        # a whole identifier (not part of another, of a dotted path, a quoted string or a flag, nor a call's first
        # keyword, in the callee's terms: ``DPStrategy(max_grad_norm=...)``), with its value if set
        pattern = rf"(?<![\w.'\"(-])({alternatives})(?![\w'\"-])(?:=({_VALUE}))?" if self.names else r"(?!)"
        object.__setattr__(self, "_pattern", re.compile(pattern))

    @classmethod
    def of_flags(cls, flags: Iterable[str], aliases: Mapping[str, str] | None = None) -> Naming:
        """The naming of a command line with ``flags`` (``--max-grad-norm``, named ``max_grad_norm`` in messages);
        ``aliases`` maps another message name to one of the flags' (``{"target_delta": "delta"}``: ``--delta``)."""
        names = {flag.removeprefix("--").replace("-", "_"): flag for flag in flags if flag.startswith("--")}
        names.update({alias: names[name] for alias, name in (aliases or {}).items() if name in names})
        return cls(names, flags=True)

    def message(self, text: str) -> str:
        """``text`` with each option named and each setting written as the user would."""

        def user(match: re.Match[str]) -> str:
            name, value = self.names[match.group(1)], match.group(2)
            if value is None:  # a one-word name alone is read as a word ("the noise"), an identifier as a name
                return name if "_" in match.group(1) or match.start() == 0 else match.group(1)
            return f"{name} {value.strip(_QUOTES)}" if self.flags else f"{name}={value}"

        return self._pattern.sub(user, text)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Rewrite the message of a ``ValueError`` raised within by :meth:`message`; the error keeps its type, its
        traceback and its :func:`~lightning_dp.config.errors.checking` mark."""
        try:
            yield
        except ValueError as error:
            if error.args and isinstance(error.args[0], str):
                error.args = (self.message(error.args[0]), *error.args[1:])
            raise
