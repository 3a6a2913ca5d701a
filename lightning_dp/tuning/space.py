"""The search space of a private search: named lists of values, of hyper-parameters that leave a candidate's privacy
event unchanged, and the uniform draw of one candidate from it (Papernot & Steinke 2022, Theorem 2 assumes that each
repetition is an independent run of one randomized algorithm: here a uniform draw of the hyper-parameters, then
training)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from lightning_dp.config import HF_NAMES, PrivacyConfig
from lightning_dp.tuning.randomness import SearchRandomness

#: Options of :class:`~lightning_dp.config.PrivacyConfig` (and their ``PrivacyArguments`` names) that a search may
#: vary: each keeps the run's privacy event (noise, sampling, steps, accountant) and adds no release. The clipping
#: bound, since the noise is ``sigma C`` (``sqrt(sum_g C_g^2)`` with groups); the clip function and its ``gamma``, and
#: group-wise clipping, which keep the sensitivity and flat clipping's accounting; per-sample momentum, which keeps
#: the sensitivity ``C``; the low-pass filter, post-processing; augmentation multiplicity, averaged before the clip;
#: the physical-batch cap, which leaves the update, the noise and the accountant as without it (their documentation
#: in ``PrivacyConfig`` says so). Every other option is refused.
EVENT_KEEPING = frozenset(
    {
        "max_grad_norm",
        "per_sample_max_grad_norm",
        "clipping_fn",
        "automatic_clipping_gamma",
        "clipping_groups",
        "momentum_length",
        "momentum_beta",
        "lowpass",
        "augmentation_multiplicity",
        "max_physical_batch_size",
        "per_example_reduction",
    }
)

#: ``PrivacyArguments``' own fields, beside ``PrivacyConfig``'s (:mod:`lightning_dp.hf.arguments`, not imported: it
#: needs the ``hf`` extra): ``per_example_reduction`` (an example's loss from its tokens) and ``disable_dp``.
HF_OWN_OPTIONS = frozenset({"per_example_reduction", "disable_dp"})

#: Settings outside the privacy configuration (the trainers' and the data's) that set the batch size, the number of
#: steps or the data a candidate sees, and the seeds.
SCHEDULE_KEYS = frozenset(
    {
        "batch_size",
        "train_batch_size",
        "per_device_train_batch_size",
        "accumulate_grad_batches",
        "gradient_accumulation_steps",
        "epochs",
        "max_epochs",
        "min_epochs",
        "num_train_epochs",
        "steps",
        "max_steps",
        "min_steps",
        "max_time",
        "limit_train_batches",
        "overfit_batches",
        "early_stopping_patience",
        "devices",
        "num_nodes",
        "dp_seed",
        "seed",
    }
)


def _option_names() -> frozenset[str]:
    """Every name of a privacy option: ``PrivacyConfig``'s fields, their ``PrivacyArguments`` names and HF's own."""
    names = {field.name for field in dataclasses.fields(PrivacyConfig)}
    return frozenset(names | {HF_NAMES.get(name, name) for name in names} | HF_OWN_OPTIONS)


#: Names a search space may not vary: every privacy option outside :data:`EVENT_KEEPING` (an option added to
#: ``PrivacyConfig`` is refused until it is shown to keep the event), and :data:`SCHEDULE_KEYS`. A search that varied
#: one would give its candidates different privacy events, or releases, which the search's one event does not cover.
PRIVACY_KEYS = (_option_names() - EVENT_KEEPING) | SCHEDULE_KEYS

#: Types of the values a search space may hold (they go into the search's state file as JSON).
VALUE_TYPES = (str, int, float, bool, type(None))


def validate_space(search_space: Mapping[str, Sequence[Any]]) -> dict[str, list[Any]]:
    """``search_space`` as ``{name: [values]}``, checked.

    Raises:
        ValueError: an empty space, a name that is not a string, a name of :data:`PRIVACY_KEYS`, or a list of values
            that is empty or holds a value that is not a string, number, bool or None.
    """
    if not isinstance(search_space, Mapping) or not search_space:
        raise ValueError(
            f"search_space must be a non-empty mapping of names to lists of values, e.g. {{'lr': [0.1, 0.5]}}, got "
            f"{search_space!r}"
        )
    space: dict[str, list[Any]] = {}
    for name, values in search_space.items():
        if not isinstance(name, str):
            raise ValueError(f"search_space names must be strings, got {name!r}")
        if name in PRIVACY_KEYS:
            raise ValueError(
                f"search_space varies {name!r}, which changes each candidate's privacy event (noise, sampling, "
                f"steps, accountant, privacy unit), adds a release, sets a seed or guards the event; fix {name!r} for "
                "all candidates and vary hyper-parameters that keep the event, such as the learning rate, "
                "max_grad_norm or momentum"
            )
        if isinstance(values, str | bytes) or not isinstance(values, Sequence) or not values:
            raise ValueError(f"search_space[{name!r}] must be a non-empty list of values, got {values!r}")
        if not all(isinstance(value, VALUE_TYPES) for value in values):
            raise ValueError(f"search_space[{name!r}] may hold strings, numbers, bools and None only, got {values!r}")
        space[name] = list(values)
    return space


def draw_candidate(space: Mapping[str, Sequence[Any]], randomness: SearchRandomness) -> dict[str, Any]:
    """One value of each name, each drawn uniformly and independently (in the space's order)."""
    return {name: values[randomness.index(len(values))] for name, values in space.items()}
