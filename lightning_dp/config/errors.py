"""One readable line for a bad option in a config file or on the command line: ``FILE: KEY: REASON`` or ``--FLAG:
REASON`` (:class:`ConfigError`, printed by :func:`lightning_dp.cli.args.guarded` with exit status 2). Validators mark
an error about one option with :func:`checking`.

Validation messages name an option by its :class:`~lightning_dp.config.PrivacyConfig` field (``max_grad_norm``) and
write a setting in Python syntax (``accountant='rdp'``). An entry point whose user names or writes options otherwise
(HF's ``PrivacyArguments``, a command line) holds one :class:`~lightning_dp.utils.naming.Naming` and validates under
its ``applied()``, so each message it raises names the user's argument as the user gave it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
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
