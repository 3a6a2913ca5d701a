"""The search space of a private search: named lists of values, of hyper-parameters that leave a candidate's privacy
event unchanged, and the uniform draw of one candidate from it (Papernot & Steinke 2022, Theorem 2 assumes that each
repetition is an independent run of one randomized algorithm: here a uniform draw of the hyper-parameters, then
training)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from lightning_dp.tuning.randomness import SearchRandomness

#: Names that set a candidate's noise, sampling, number of steps or accountant: a search that varied one would give its
#: candidates different privacy events, which the search's one event does not cover.
PRIVACY_KEYS = frozenset(
    {
        "noise_multiplier",
        "target_epsilon",
        "target_delta",
        "noise",
        "noise_params",
        "accountant",
        "sample_rate",
        "batch_size",
        "accumulate_grad_batches",
        "gradient_accumulation_steps",
        "epochs",
        "max_epochs",
        "num_train_epochs",
        "steps",
        "max_steps",
        "clipping",
        "projection_dim",
        "poisson_sampling",
        "privacy_unit",
        "examples_per_user",
    }
)

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
                f"search_space varies {name!r}, which changes each candidate's privacy event (noise, sampling or "
                f"steps); fix {name!r} for all candidates and vary hyper-parameters that keep the event, such as the "
                "learning rate, max_grad_norm or momentum"
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
