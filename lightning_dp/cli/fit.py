"""The LightningCLI of ``lightning-dp fit``, whose config errors are one readable line.

A bad option becomes a :class:`~lightning_dp.config.errors.ConfigError` naming its full path and the reason
(``fit.yaml: trainer.strategy.init_args.max_grad_nrom: unknown option; did you mean 'max_grad_norm'?``): jsonargparse's
errors are read back by :mod:`lightning_dp.cli.jsonargparse_errors`, and a DP strategy's privacy options are checked
by :class:`~lightning_dp.config.PrivacyConfig` before instantiation. A misspelt ``class_path`` is reported under that
key with the closest importable class of the option's type (:func:`close_class_path`). The progress display suits the
standard output (:func:`choose_progress_display`).
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
import sys
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any

from jsonargparse import ArgumentError, ArgumentParser, Namespace
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback

from lightning_dp.cli.jsonargparse_errors import UNION, ReadError, read_error
from lightning_dp.config import OPTION_NAMES, REMOVED_OPTIONS, PrivacyConfig
from lightning_dp.config.errors import ConfigError, invalid_option, option_reason, unknown_option
from lightning_dp.lightning.callbacks import EpochTable
from lightning_dp.lightning.dp_mixin import DPStrategyMixin
from lightning_dp.lightning.progress import TrainingProgress
from lightning_dp.lightning.progress_bar import epsilon_progress_bar_class, is_terminal

#: where LightningCLI configures the strategy.
STRATEGY = "trainer.strategy"


class KeepingSaveConfigCallback(SaveConfigCallback):
    """Lightning's ``SaveConfigCallback``, whose refusal to overwrite a ``config.yaml`` is one line."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Save as Lightning does.

        Raises:
            ValueError: the log folder already holds a ``config.yaml``.
        """
        try:
            super().setup(trainer, pl_module, stage)
        except RuntimeError as error:
            if "to NOT exist" not in str(error):
                raise
            folder = trainer.log_dir
            raise ValueError(
                f"{folder}/{self.config_filename} holds an earlier run's config, which this run would overwrite: give "
                "it another --trainer.default_root_dir, or a logger (each run then gets its own version folder)"
            ) from error


class FitCLI(LightningCLI):
    """``LightningCLI`` whose errors about an option are :class:`~lightning_dp.config.errors.ConfigError`; others are
    raised as they come (``ArgumentError``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, save_config_callback=KeepingSaveConfigCallback, **kwargs)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        """Parse as LightningCLI does; keep the command line, to say whether a flag or which file set an option.

        Raises:
            ConfigError: an unknown option, or a value of the wrong type.
        """
        self.argv: list[str] = sys.argv[1:] if args is None else list(args) if isinstance(args, list) else []
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as error:
            read = read_error(str(error))
            if not read.key:
                raise
            if read.missing_class is not None:
                bases = [_import(base) for base in read.bases]
                close = close_class_path(read.missing_class, [base for base in bases if isinstance(base, type)])
                hint = f"; did you mean {close!r}?" if close else f" ({read.reason})"
                reason = f"cannot import {read.missing_class!r}{hint}"
                raise ConfigError(read.key, reason, self.argv) from error
            raise ConfigError(read.key, _reason(read, error), self.argv) from error

    def before_instantiate_classes(self) -> None:
        """Check the privacy options (:func:`check_privacy_options`), choose the progress display
        (:func:`choose_progress_display`)."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        check_privacy_options(config, self.argv)
        choose_progress_display(config, is_terminal())

    def instantiate_classes(self) -> None:
        """Instantiate as LightningCLI does.

        Raises:
            ValueError: a constructor's error, prefixed by its class path (without jsonargparse's account of the
                unions).
        """
        try:
            super().instantiate_classes()
        except ValueError as error:
            if not str(error).startswith(UNION):
                raise
            read = read_error(str(error))
            raise ValueError(f"{read.class_path}: {read.reason}" if read.class_path else read.reason) from error


def check_privacy_options(config: Namespace, argv: Sequence[str] = ()) -> None:
    """Validate a DP strategy's privacy options (``trainer.strategy`` of a parsed ``config``) with
    :class:`~lightning_dp.config.PrivacyConfig` before instantiation; ``argv`` tells which flag or file set them.

    Raises:
        ConfigError: an invalid option (key ``trainer.strategy.init_args.OPTION``) or combination (key
            ``trainer.strategy.init_args``).
    """
    strategy = config.get(STRATEGY)
    if not isinstance(strategy, Namespace) or not isinstance(strategy.get("class_path"), str):
        return
    cls = _import(strategy.class_path)
    if not (isinstance(cls, type) and issubclass(cls, DPStrategyMixin)):
        return
    init_args = strategy.get("init_args") or Namespace()
    options = {name: init_args[name] for name in OPTION_NAMES if name in init_args}
    if any(isinstance(value, Namespace) for value in options.values()):
        return  # an option given as a class (a NoiseMechanism, a LowPassFilter): checked when the strategy is built
    try:
        PrivacyConfig(**options)
    except ValueError as error:
        option = invalid_option(error)
        if option is None:  # about a combination of options, which may come from several places: no file named
            raise ConfigError(f"{STRATEGY}.init_args", str(error)) from error
        raise ConfigError(f"{STRATEGY}.init_args.{option}", option_reason(option, error), argv) from error


def choose_progress_display(config: Namespace, terminal: bool) -> None:
    """Set the progress display of a parsed ``config`` whose Trainer shows Lightning's default bar: in a terminal,
    the bar with epsilon to four decimals (:mod:`lightning_dp.lightning.progress_bar`); otherwise no bar, and
    :class:`~lightning_dp.TrainingProgress`'s line every ``log_every_n_steps`` steps unless a callback of the config
    prints its own lines (an epoch table, progress lines). A config that disables the bar or names one is kept as it
    is; the run's saved ``config.yaml`` holds the choice.
    """
    listed = config.get("trainer.callbacks") or []
    callbacks = [listed] if isinstance(listed, Namespace) else list(listed)
    classes = [_import(callback.class_path) for callback in callbacks]
    if config.get("trainer.enable_progress_bar") is False or any(issubclass(c, ProgressBar) for c in classes):
        return
    if terminal:
        added: type | None = epsilon_progress_bar_class()
    else:
        config["trainer.enable_progress_bar"] = False
        added = None if any(issubclass(c, (EpochTable, TrainingProgress)) for c in classes) else TrainingProgress
    if added is not None:
        path = f"{added.__module__}.{added.__qualname__}"
        config["trainer.callbacks"] = [*callbacks, Namespace(class_path=path, init_args=Namespace())]


def _reason(read: ReadError, error: ArgumentError) -> str:
    """The reason of a jsonargparse error read back, with the closest accepted option for an unknown one."""
    if not read.unknown:
        return read.reason
    name = read.key.rpartition(".")[2]
    if name in REMOVED_OPTIONS and read.key.startswith(f"{STRATEGY}."):
        return f"option {REMOVED_OPTIONS[name]}"
    if read.class_path is not None:  # an argument of a class: among the class's
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(_import(read.class_path))
        keys, prefix = parser.get_defaults(skip_validation=True).keys(), ""
    else:  # an option of the subcommand: among those next to it
        subcommand_parser = getattr(error.__cause__, "subcommand_parser", None)
        keys = subcommand_parser.get_defaults(skip_validation=True).keys() if subcommand_parser else []
        prefix = read.key.removesuffix(name)
    return unknown_option(name, {key.removeprefix(prefix).split(".")[0] for key in keys if key.startswith(prefix)})


def close_class_path(class_path: str, bases: Sequence[type]) -> str | None:
    """The importable class path closest to ``class_path`` (``difflib.get_close_matches``) among the subclasses of
    ``bases``, or ``None``. From the longest importable module of ``class_path``, each part that is not there is read
    as the closest name there (a submodule, or at the end a subclass of ``bases``); failing that, the closest among
    the subclasses of ``bases`` imported so far, by their full path."""
    parts = class_path.split(".")
    start = next((i for i in range(len(parts) - 1, 0, -1) if _importable(".".join(parts[:i]))), 0)
    found: Any = importlib.import_module(".".join(parts[:start])) if start else None
    path = parts[:start]
    for position, part in enumerate(parts[start:], start):
        last = position == len(parts) - 1
        match = _closest_class(found, part, bases) if last else _closest_module(found, part)
        if match is None:
            path = []
            break
        path.append(match)
        found = None if last else importlib.import_module(".".join(path))
    if path:
        return ".".join(path)
    loaded = {f"{cls.__module__}.{cls.__qualname__}" for base in bases for cls in _subclasses(base)}
    match = difflib.get_close_matches(class_path, sorted(loaded), n=1)
    return match[0] if match else None


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _closest_module(module: ModuleType | None, name: str) -> str | None:
    """The submodule of a package (found without importing them) or module attribute closest to ``name``."""
    if module is None:
        return None
    names = {key for key, value in vars(module).items() if isinstance(value, ModuleType)}
    names.update(info.name for info in pkgutil.iter_modules(getattr(module, "__path__", [])))
    match = difflib.get_close_matches(name, sorted(names), n=1)
    return match[0] if match else None


def _closest_class(module: ModuleType | None, name: str, bases: Sequence[type]) -> str | None:
    """The public name of ``module`` closest to ``name`` that is a subclass of ``bases`` (any class when no base is
    known); only the close names are imported (a package may import its names on first use)."""
    if module is None:
        return None
    public = [key for key in dir(module) if not key.startswith("_")]
    for match in difflib.get_close_matches(name, public, n=5):
        value = getattr(module, match, None)
        if isinstance(value, type) and (not bases or issubclass(value, tuple(bases))):
            return match
    return None


def _subclasses(base: type) -> Iterable[type]:
    for cls in base.__subclasses__():
        yield cls
        yield from _subclasses(cls)


def _import(class_path: str) -> Any:
    """The object at ``module.name``."""
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)
