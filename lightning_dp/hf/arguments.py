"""``PrivacyArguments``: the privacy configuration of a ``DPTrainer`` run, parsable by ``HfArgumentParser``.

It is generated from :class:`~lightning_dp.config.PrivacyConfig`, field by field (same defaults, help text and
documentation), with two names that ``TrainingArguments`` already has renamed (``HfArgumentParser((TrainingArguments,
PrivacyArguments))`` refuses duplicate flags; :data:`~lightning_dp.config.HF_NAMES`): the clipping bound is
``per_sample_max_grad_norm`` (the dp-transformers name) and the seed is ``dp_seed``. Where the configuration takes a
dict, the command line may give its JSON text. Two fields are HF's own, ``per_example_reduction`` and
``disable_dp``. ``__post_init__`` validates by building the :class:`~lightning_dp.config.PrivacyConfig` they
describe, so a bad combination fails when the arguments are parsed, not at the first step.
"""

from __future__ import annotations

import json
import typing
from dataclasses import field, fields, make_dataclass
from typing import Any, Literal

from lightning_dp.config import HF_NAMES, PrivacyConfig, option_docs
from lightning_dp.config.errors import checking
from lightning_dp.engine.privacy_engine import PrivacyEngine
from lightning_dp.utils.naming import Naming

PER_EXAMPLE_REDUCTIONS = ("mean", "sum")

#: how the errors of a configuration built from ``PrivacyArguments`` name its options: by their HF names.
HF_NAMING = Naming(HF_NAMES)

#: options whose HF type differs from the configuration's: a mechanism instance cannot be parsed from the command
#: line, and a dict or a list of groups may come as JSON text. ``HfArgumentParser`` parses a union holding ``str``
#: and ``None`` as its second member's type: ``str`` here, converted by ``__post_init__``.
_HF_TYPES: dict[str, Any] = {
    "noise": str,
    "noise_params": dict[str, Any] | str | None,
    "lowpass": dict[str, Any] | str | None,
    "max_grad_norm": float | str | list[float] | None,
    "clipping_groups": list[list[str]] | str | None,
    "user_key": str | None,
}
#: extra ``argparse`` settings of an option's flag: the clipping bound takes several values (one per group).
_HF_FLAGS: dict[str, dict[str, Any]] = {"max_grad_norm": {"nargs": "+"}}


def _parse_bounds(value: Any) -> Any:
    """``per_sample_max_grad_norm`` from the command line (a list of strings, ``nargs='+'``: one value is a number
    or a JSON list, several values are one bound each) as a number or a list of numbers; any other value as is.

    Raises:
        ValueError: a value that is not a number (or a JSON list of numbers), marked as about ``max_grad_norm``
            (:func:`~lightning_dp.config.errors.checking`).
    """
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(text, str) for text in texts):
        return value
    try:
        if len(texts) == 1 and texts[0].lstrip().startswith("["):
            return json.loads(texts[0])
        numbers = [float(text) for text in texts]
    except ValueError as error:
        with checking("max_grad_norm"):
            raise ValueError(
                "per_sample_max_grad_norm must be a number, or one number per clipping group (several values or a "
                f"JSON list such as '[0.5, 0.7]'), got {' '.join(texts)!r}"
            ) from error
    return numbers[0] if len(numbers) == 1 else numbers


def _parse_groups(value: Any) -> Any:
    """``clipping_groups`` given as JSON text (``'[["encoder.*"], ["classifier.*"]]'``) as a list; other values as
    they are (``"per_layer"`` among them).

    Raises:
        ValueError: text that starts as a JSON list but is not one.
    """
    if not isinstance(value, str) or not value.lstrip().startswith("["):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as error:
        raise ValueError(
            "clipping_groups must be 'per_layer' or a JSON list of groups of parameter-name patterns such as "
            f'\'[["encoder.*"], ["classifier.*", "pooler.*"]]\', got {value!r}'
        ) from error


class _PrivacyArgumentsBehaviour:
    """Parsing of JSON text, HF's own field, and the mapping onto :class:`~lightning_dp.config.PrivacyConfig`."""

    def __post_init__(self) -> None:
        if isinstance(self.noise_params, str):
            try:
                self.noise_params = json.loads(self.noise_params)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"noise_params must be a JSON object such as '{{\"noise_scale\": 3.0}}', got {self.noise_params!r}"
                ) from error
        if self.noise_params is not None and not isinstance(self.noise_params, dict):
            raise ValueError(f"noise_params must be a dict (JSON object), got {self.noise_params!r}")
        if isinstance(self.lowpass, str) and self.lowpass.lstrip().startswith("{"):
            try:
                self.lowpass = json.loads(self.lowpass)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f'lowpass must be a preset name or a JSON object such as \'{{"a": [-0.9], "b": [0.1]}}\', got '
                    f"{self.lowpass!r}"
                ) from error
        self.per_sample_max_grad_norm = _parse_bounds(self.per_sample_max_grad_norm)
        self.clipping_groups = _parse_groups(self.clipping_groups)
        if self.per_example_reduction not in PER_EXAMPLE_REDUCTIONS:
            raise ValueError(
                f"per_example_reduction must be one of {PER_EXAMPLE_REDUCTIONS}, got {self.per_example_reduction!r}"
            )
        self.to_config()  # validates every privacy argument

    def to_config(self) -> PrivacyConfig:
        """The :class:`~lightning_dp.config.PrivacyConfig` these arguments describe. Raises ``ValueError`` as it, naming
        the options by their HF names (:data:`HF_NAMING`)."""
        with HF_NAMING.applied():
            return PrivacyConfig(**{name: getattr(self, HF_NAMES.get(name, name)) for name in _OPTION_NAMES})

    def make_privacy_engine(self) -> PrivacyEngine:
        """A fresh :class:`PrivacyEngine` for these arguments. Raises ``ValueError`` as :meth:`to_config`."""
        return PrivacyEngine(self.to_config())


_OPTION_NAMES = [f.name for f in fields(PrivacyConfig)]
_HINTS = typing.get_type_hints(PrivacyConfig)

PrivacyArguments = make_dataclass(
    "PrivacyArguments",
    [
        *(
            (
                HF_NAMES.get(f.name, f.name),
                _HF_TYPES.get(f.name, _HINTS[f.name]),
                field(default=f.default, metadata={"help": f.metadata["help"], **_HF_FLAGS.get(f.name, {})}),
            )
            for f in fields(PrivacyConfig)
        ),
        (
            "per_example_reduction",
            Literal["mean", "sum"],
            field(default="mean", metadata={"help": "Reduce an example's token losses by their mean or sum."}),
        ),
        (
            "disable_dp",
            bool,
            field(
                default=False,
                metadata={"help": "Train without DP (the plain Trainer's training; a non-private baseline)."},
            ),
        ),
    ],
    bases=(_PrivacyArgumentsBehaviour,),
)  # positional order: PrivacyConfig's (the same as before up to dp_seed), then per_example_reduction, disable_dp
PrivacyArguments.__module__ = __name__
PrivacyArguments.__doc__ = f"""Differential-privacy arguments of :class:`~lightning_dp.hf.DPTrainer`.

    ``HfArgumentParser((TrainingArguments, PrivacyArguments))`` parses them from the command line
    (``--target_epsilon 3 --per_sample_max_grad_norm 1.0 --noise_params '{{"noise_scale": 2.0}}'``), a JSON file or
    a YAML file. The fields are those of :class:`~lightning_dp.config.PrivacyConfig` (``per_sample_max_grad_norm``
    and ``dp_seed`` for its ``max_grad_norm`` and ``seed``; ``per_sample_max_grad_norm`` is not
    ``TrainingArguments.max_grad_norm``, the clipping of the batch gradient, which DPTrainer switches off), plus
    ``per_example_reduction`` and ``disable_dp``. Group-wise clipping on the command line: ``--clipping_groups
    per_layer`` or ``--clipping_groups '[["bert.*"], ["classifier.*"]]'`` (JSON), with one number or one per group
    (``--per_sample_max_grad_norm 0.5 0.7``).

    Attributes:
{option_docs(HF_NAMES, indent=8)}
        per_example_reduction: how an example's token losses become its one loss: ``"mean"`` over its non-ignored
            tokens (default: every example weighs the same whatever its length) or ``"sum"`` (long examples weigh
            more, and are clipped more often). Labels ``-100`` are ignored either way.
        disable_dp: train without differential privacy (dp-transformers' name): ``DPTrainer`` then trains exactly as
            the plain ``Trainer`` (its sampler, optimizer, loss and ``max_grad_norm``), logging ``epsilon = inf``,
            so a non-private baseline is the same script with one flag. The other privacy arguments are still
            validated, and ignored.

    Raises:
        ValueError: any invalid value or combination, with what to change (same rules as ``DPStrategy``).
    """
