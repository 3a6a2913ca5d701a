"""One config system for every HF recipe: ``HfArgumentParser`` over the recipe's dataclasses, with a YAML file.

``recipe.py --config configs/task.yaml --learning_rate 1e-3 --target_epsilon 8`` reads the YAML's keys as the
parser's defaults and then parses the command line, so any field of the recipe's arguments,
``transformers.TrainingArguments`` or :class:`~lightning_dp.hf.PrivacyArguments` is settable in the file, and the
command line overrides the file. The YAML is flat (one key per field, the field's own name), exactly the names of
the command-line flags without ``--``; an unknown key fails before anything runs, with the closest known names.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser

from lightning_dp.naming import did_you_mean


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

    Args:
        dataclass_types: the dataclasses whose fields make the options (HfArgumentParser refuses a field name that
            two of them share).
        argv: the command line without the program name (default ``sys.argv[1:]``).
        description: the ``--help`` text.

    Returns:
        One instance per dataclass, in the order given (their ``__post_init__`` validations have run).

    Raises:
        FileNotFoundError: the config file does not exist.
        ValueError: a key of the config file is not a field of any of the dataclasses, or a value is invalid.
        SystemExit: an unknown or malformed command-line option (argparse's usual exit code 2).
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(argv)
    parser = HfArgumentParser(tuple(dataclass_types), description=description)
    parser.add_argument("--config", default=None, help="YAML file of field: value defaults (flags override it)")
    if known.config is not None:
        config = read_yaml_config(known.config)
        fields = {f.name for cls in dataclass_types for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(config) - fields)
        if unknown:
            hint = did_you_mean(unknown[0], sorted(fields))
            raise ValueError(f"{known.config}: unknown key(s) {', '.join(unknown)}{hint}")
        parser.set_defaults(**{key: None for key, value in config.items() if value is None})
        rest = [*config_as_flags(config), *rest]
    *parsed, _ = parser.parse_args_into_dataclasses(args=rest, return_remaining_strings=False)
    return tuple(parsed)


def config_as_flags(config: dict[str, Any]) -> list[str]:
    """The command-line flags that say what ``config`` says (``None`` values excepted), so that the file's values go
    through the same type conversion and checks as typed flags, and flags given later override them: booleans as
    ``true``/``false``, lists as several values, mappings as JSON text."""
    flags: list[str] = []
    for key, value in config.items():
        if value is None:
            continue
        if isinstance(value, bool):
            flags += [f"--{key}", str(value).lower()]
        elif isinstance(value, list | tuple):
            flags += [f"--{key}", *(str(v) for v in value)]
        elif isinstance(value, dict):
            flags += [f"--{key}", json.dumps(value)]
        else:
            flags += [f"--{key}", str(value)]
    return flags
