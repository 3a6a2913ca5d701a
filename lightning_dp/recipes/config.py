"""One config system for every HF recipe: ``HfArgumentParser`` over the recipe's dataclasses, with a YAML file.

``recipe.py --config configs/task.yaml --learning_rate 1e-3`` reads the YAML's keys (flat, the flags' names without
``--``) as defaults, then the command line overrides them; an unknown key fails with the closest known name. ``--FIELD
null`` (or ``FIELD: null``) unsets an optional field.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser

from lightning_dp.config import HF_NAMES
from lightning_dp.config.errors import ConfigError, invalid_option, option_reason, unknown_option


def read_yaml_config(path: str | Path) -> dict[str, Any]:
    """The mapping of a YAML config file.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a YAML mapping.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} not found (give --config PATH_TO.yaml)")
    with path.open(encoding="utf-8") as handle:
        loaded = yaml.safe_load(handle)
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of field: value, got {type(loaded).__name__}")
    return loaded


def parse_recipe_args(
    dataclass_types: Sequence[type], argv: Sequence[str] | None = None, description: str | None = None
) -> tuple[Any, ...]:
    """Parse ``--config FILE.yaml`` plus command-line overrides into one instance of each of ``dataclass_types``.

    A bad option is one :class:`~lightning_dp.config.errors.ConfigError` line naming the file and key, or the flag,
    that set it (``glue.yaml: per_sample_max_grad_nrom: unknown option; did you mean 'per_sample_max_grad_norm'?``):
    an unknown key or flag, a value of the wrong type, an invalid privacy option
    (:class:`~lightning_dp.hf.PrivacyArguments`, named as it is there).

    Args:
        dataclass_types: the dataclasses whose fields make the options (HfArgumentParser refuses a field name that
            two of them share).
        argv: the command line without the program name (default ``sys.argv[1:]``).
        description: the ``--help`` text.

    Returns:
        One instance per dataclass, in the order given (their ``__post_init__`` validations have run).

    Raises:
        FileNotFoundError: the config file does not exist.
        ConfigError: an unknown key or flag, a value of the wrong type, or an invalid privacy option.
        ValueError: another invalid value (a dataclass's own check), or a stray argument.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(argv)
    rest, unset = unset_flags(rest, optional_fields(dataclass_types))
    parser = HfArgumentParser(tuple(dataclass_types), description=description, exit_on_error=False)
    parser.add_argument("--config", default=None, help="YAML file of field: value defaults (flags override it)")
    fields = sorted({f.name for cls in dataclass_types for f in dataclasses.fields(cls) if f.init})
    config = {}
    if known.config is not None:
        config = read_yaml_config(known.config)
        for key in config:
            if key not in fields:
                raise ConfigError(key, unknown_option(key, fields), argv)
    config.update(dict.fromkeys(unset))
    parser.set_defaults(**{key: None for key, value in config.items() if value is None})
    rest = [*config_as_flags(config), *rest]
    try:
        *parsed, _, remaining = parser.parse_args_into_dataclasses(args=rest, return_remaining_strings=True)
    except argparse.ArgumentError as error:  # a value argparse cannot convert (of the flag, or of the file's key)
        if error.argument_name is None:
            raise ValueError(str(error)) from error
        raise ConfigError(error.argument_name.split("/")[0].lstrip("-"), error.message, argv) from error
    except ValueError as error:  # a dataclass's check: an invalid privacy option names its key
        option = invalid_option(error)
        if option is None:
            raise
        name = HF_NAMES.get(option, option)  # a reason may name the option by its HF name
        raise ConfigError(name, option_reason(option, error).removeprefix(f"{name} "), argv) from error
    flags = [arg.partition("=")[0] for arg in remaining if arg.startswith("--")]
    if flags:
        raise ConfigError(flags[0][2:], unknown_option(flags[0], [f"--{name}" for name in fields]), argv)
    if remaining:
        raise ValueError(f"unrecognized arguments: {' '.join(remaining)}")
    return tuple(parsed)


#: What ``--FIELD VALUE`` says to unset a field whose type admits ``None`` (as ``FIELD: null`` in the YAML). Only
#: ``null``: ``none`` is a value of its own for some fields (``--report_to none``: no integrations).
NULL_VALUES = ("null",)


def optional_fields(dataclass_types: Sequence[type]) -> set[str]:
    """The init fields whose annotated type admits ``None`` (``X | None``, ``Optional[X]``) and no list, read from
    the classes' annotations (``HfArgumentParser`` rewrites ``Field.type`` without the ``None``). List fields take
    several values and ``None`` is not one the Trainer accepts for them (``report_to``: use ``none``)."""
    names = set()
    for cls in dataclass_types:
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            members = typing.get_args(hints.get(field.name))
            is_list = any(typing.get_origin(member) is list or member is list for member in members)
            if field.init and type(None) in members and not is_list:
                names.add(field.name)
    return names


def unset_flags(args: list[str], optional: set[str]) -> tuple[list[str], list[str]]:
    """Split ``--FIELD null`` (or ``--FIELD=null``) of the ``optional`` fields out of ``args``.

    Returns:
        ``args`` without those flags, and the fields they unset (a value of the same field given by another flag wins).
    """
    kept: list[str] = []
    unset: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        name, equals, value = arg.partition("=")
        field = name[2:] if name.startswith("--") else None
        if field in optional and equals and value in NULL_VALUES:
            unset.append(field)
        elif field in optional and not equals and index + 1 < len(args) and args[index + 1] in NULL_VALUES:
            unset.append(field)
            index += 1
        else:
            kept.append(arg)
        index += 1
    return kept, unset


def config_as_flags(config: dict[str, Any]) -> list[str]:
    """The command-line flags that say what ``config`` says (``None`` values excepted), so that the file's values go
    through the same type conversion and checks as typed flags, and flags given later override them: booleans as
    ``true``/``false``, lists as several values, mappings and lists of lists as JSON text."""
    flags: list[str] = []
    for key, value in config.items():
        if value is None:
            continue
        if isinstance(value, bool):
            flags += [f"--{key}", str(value).lower()]
        elif isinstance(value, list | tuple) and any(isinstance(v, list | tuple | dict) for v in value):
            flags += [f"--{key}", json.dumps(value)]  # nested (clipping_groups' groups of patterns): JSON text
        elif isinstance(value, list | tuple):
            flags += [f"--{key}", *(str(v) for v in value)]
        elif isinstance(value, dict):
            flags += [f"--{key}", json.dumps(value)]
        else:
            flags += [f"--{key}", str(value)]
    return flags
