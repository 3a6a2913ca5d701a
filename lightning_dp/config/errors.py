"""One readable line for a bad option in a config file or on the command line: ``FILE: KEY: REASON`` or ``--FLAG:
REASON`` (:class:`ConfigError`, printed by :func:`lightning_dp.cli.args.guarded` with exit status 2). Validators mark
an error about one option with :func:`checking`.

Validation messages name an option by its :class:`~lightning_dp.config.PrivacyConfig` field (``max_grad_norm``) and
write a setting in Python syntax (``accountant='rdp'``). An entry point whose user names or writes options otherwise
(HF's ``PrivacyArguments``, a command line) holds one :class:`Naming` and validates under :meth:`Naming.applied`, so
each message it raises names the user's argument as the user gave it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_dp.utils.naming import closest

#: the attribute of a ``ValueError`` naming the option it is about (see :func:`checking`).
_OPTION_ATTRIBUTE = "lightning_dp_option"


@contextmanager
def checking(option: str) -> Iterator[None]:
    """Mark a ``ValueError`` raised within as about ``option`` (read back by :func:`invalid_option`); the error
    itself (type, message, traceback) is unchanged, and an error already marked keeps its option."""
    try:
        yield
    except ValueError as error:
        if invalid_option(error) is None:
            setattr(error, _OPTION_ATTRIBUTE, option)
        raise


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
            return f"{name} {value.strip(chr(39) + chr(34))}" if self.flags else f"{name}={value}"

        return self._pattern.sub(user, text)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Rewrite the message of a ``ValueError`` raised within by :meth:`message`; the error keeps its type, its
        traceback and its :func:`checking` mark."""
        try:
            yield
        except ValueError as error:
            if error.args and isinstance(error.args[0], str):
                error.args = (self.message(error.args[0]), *error.args[1:])
            raise


def invalid_option(error: BaseException) -> str | None:
    """The option a validation error is about (marked by :func:`checking`), or ``None``: an error about a
    combination of options, or not a validation error."""
    return getattr(error, _OPTION_ATTRIBUTE, None)


class ConfigError(ValueError):
    """An invalid option of a config file or command line; its message is ``WHERE: REASON`` (see :func:`locate`).

    Attributes:
        key: the option's full path (``trainer.strategy.init_args.max_grad_norm``; a recipe's field name).
        reason: what is wrong, with the closest valid name where one exists.
    """

    def __init__(self, key: str, reason: str, argv: Sequence[str] = ()) -> None:
        self.key = key
        self.reason = reason
        super().__init__(f"{locate(key, argv)}: {reason}")


def unknown_option(name: str, valid: Iterable[str]) -> str:
    """The reason for an unknown option ``name``: ``"unknown option; did you mean 'x'?"``, the suggestion only where
    a valid name is close (:func:`~lightning_dp.utils.naming.closest`)."""
    close = closest(name, valid)
    return "unknown option" + (f"; did you mean {close!r}?" if close else "")


def option_reason(option: str, error: BaseException) -> str:
    """The message of a validation error about ``option`` without the option's name where the message starts with it
    (the key already names it): ``"max_grad_norm must be positive"`` becomes ``"must be positive"``."""
    return str(error).removeprefix(f"{option} ")


def locate(key: str, argv: Sequence[str]) -> str:
    """How a message names option ``key`` set by ``argv``: the flag as typed, else ``FILE: key`` for the last
    ``--config`` file holding it, else ``key``.
    """
    for arg in argv:
        name = arg.partition("=")[0]
        if name.startswith("--") and _plain(name[2:]) == _plain(key):
            return name
    holding = [path for path in _config_files(argv) if _holds(path, _plain(key))]
    return f"{holding[-1]}: {key}" if holding else key


def _plain(key: str) -> list[str]:
    """``key``'s parts without ``init_args`` levels, dashes read as underscores (``--per-sample-max-grad-norm``)."""
    return [part for part in key.replace("-", "_").split(".") if part != "init_args"]


def _config_files(argv: Sequence[str]) -> list[str]:
    """The files of ``--config FILE`` / ``--config=FILE`` in ``argv``, in order."""
    files = []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            files.append(argv[i + 1])
        elif arg.startswith("--config="):
            files.append(arg.partition("=")[2])
    return files


def _holds(path: str, parts: list[str]) -> bool:
    """Whether the YAML file ``path`` sets the key ``parts`` (:func:`_plain`: a class's ``init_args`` level is entered
    where a part is not found above it); ``False`` for a file that cannot be read."""
    import yaml

    try:
        data: Any = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return False
    for part in parts:
        if isinstance(data, dict) and part not in data and isinstance(data.get("init_args"), dict):
            data = data["init_args"]
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True
