"""Group-wise clipping: the trainable parameters split into groups, each example's gradient clipped per group.

He, Li, Yu, Zhang, Kulkarni, Lee, Backurs, Yu and Bian 2022, "Exploring the limits of differentially private deep
learning with group-wise clipping", Section 3. Factors ``c_gi = min(1, C_g / (nu_gi + 1e-6))``; l2 sensitivity
``sqrt(sum_g C_g^2)`` (docs/design.md sections 4.7 and 4.10). ``clipping_groups``: ``None`` (flat), ``"per_layer"``
(one group per module owning trainable parameters, ``named_modules`` order) or a list of groups of ``fnmatch``
patterns matching every trainable parameter exactly once. A float ``max_grad_norm = C`` gives each of ``G`` groups
``C / sqrt(G)``; a list gives one bound per group.
"""

from __future__ import annotations

import fnmatch
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard, cast

from lightning_dp.utils.naming import did_you_mean

#: ``clipping_groups`` value for one group per module owning trainable parameters.
PER_LAYER = "per_layer"

#: What ``clipping_groups`` takes: ``None``, :data:`PER_LAYER`, or groups of ``fnmatch`` patterns.
GroupsSpec = str | Sequence[Sequence[str]] | None
#: What ``max_grad_norm`` takes: one bound (split equally over the groups) or one bound per group.
Bounds = float | Sequence[float]


def is_bound_list(max_grad_norm: object) -> TypeGuard[Sequence[Any]]:
    """Whether ``max_grad_norm`` is a list (any sequence but a string) of bounds, one per group."""
    return isinstance(max_grad_norm, Sequence) and not isinstance(max_grad_norm, str)


def single_bound(max_grad_norm: Bounds) -> float:
    """The bound of a ``max_grad_norm`` that is one number (not a list: :func:`is_bound_list`), as a float."""
    return float(cast(float, max_grad_norm))


def _bound_list(max_grad_norm: Bounds) -> list[float] | None:
    """The bounds of a list ``max_grad_norm`` as floats, or ``None`` for a single number."""
    return [float(bound) for bound in max_grad_norm] if is_bound_list(max_grad_norm) else None


def _pattern_groups(clipping_groups: GroupsSpec) -> list[tuple[str, ...]] | None:
    """The pattern groups of ``clipping_groups`` as tuples (a string is one pattern), or ``None``."""
    if clipping_groups is None or isinstance(clipping_groups, str):
        return None
    return [(group,) if isinstance(group, str) else tuple(group) for group in clipping_groups]


def validate_bounds(max_grad_norm: Bounds) -> None:
    """Check ``max_grad_norm``: a positive finite number, or a non-empty list of them.

    Raises:
        ValueError: a bound that is not a positive finite number (``bool`` included); an empty list.
    """
    if not is_bound_list(max_grad_norm):
        if not _positive_finite(max_grad_norm):
            raise ValueError(f"max_grad_norm must be a positive finite number, got {max_grad_norm!r}")
        return
    if not max_grad_norm or not all(_positive_finite(bound) for bound in max_grad_norm):
        raise ValueError(
            "max_grad_norm must be a positive finite number, or a non-empty list of them (one per clipping group), "
            f"got {max_grad_norm!r}"
        )


def _positive_finite(value: object) -> bool:
    # numbers.Real declares no comparison with int for the type checker; every Real compares with numbers
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and 0 < cast(float, value) < math.inf


def validate_clipping_groups(clipping_groups: GroupsSpec, max_grad_norm: Bounds) -> None:
    """The checks of ``clipping_groups`` (with an already checked ``max_grad_norm``) that need no model.

    Raises:
        ValueError: a list ``max_grad_norm`` without ``clipping_groups``; a string other than ``"per_layer"``; an empty
            list or group, or a pattern that is not a non-empty string; a list of bounds of another length than the
            pattern groups.
    """
    bounds = _bound_list(max_grad_norm)
    if clipping_groups is None:
        if bounds is not None:
            raise ValueError(
                f"max_grad_norm={list(bounds)} is a list (one bound per group), but clipping_groups is not set: add "
                f"clipping_groups='{PER_LAYER}' (one group per layer) or clipping_groups=[[patterns], ...], or give "
                "one number for flat clipping"
            )
        return
    if isinstance(clipping_groups, str):
        if clipping_groups != PER_LAYER:
            raise ValueError(
                f"clipping_groups must be '{PER_LAYER}' or a list of groups of parameter-name patterns, got "
                f"{clipping_groups!r}{did_you_mean(clipping_groups, [PER_LAYER])}"
            )
        return
    groups = _pattern_groups(clipping_groups) if isinstance(clipping_groups, Sequence) else None
    if not groups:
        raise ValueError(
            f"clipping_groups must be '{PER_LAYER}' or a non-empty list of groups, each a list of fnmatch patterns on "
            f"parameter names (e.g. [['encoder.*'], ['classifier.*', 'pooler.*']]), got {clipping_groups!r}"
        )
    for index, group in enumerate(groups):
        if not group or not all(isinstance(pattern, str) and pattern for pattern in group):
            raise ValueError(
                f"clipping_groups[{index}] must be a non-empty list of non-empty fnmatch patterns (strings), got "
                f"{clipping_groups[index]!r}"
            )
    if bounds is not None and len(bounds) != len(groups):
        raise ValueError(
            f"max_grad_norm has {len(bounds)} bounds but clipping_groups has {len(groups)} groups: give one bound "
            "per group, in the order of the groups, or one number (split equally, C / sqrt(G) each)"
        )


def sensitivity(max_grad_norm: Bounds) -> float:
    """The l2 sensitivity of the clipped sum: ``C``, or ``sqrt(sum_g C_g^2)`` for group bounds (He et al. 2022, Section
    3)."""
    bounds = _bound_list(max_grad_norm)
    if bounds is None:
        return single_bound(max_grad_norm)
    return math.sqrt(math.fsum(bound * bound for bound in bounds))


@dataclass(frozen=True)
class ClippingGroups:
    """The resolved groups of one model.

    Attributes:
        spec: ``"per_layer"``, or the pattern groups (tuples).
        labels: one name per group (module name, ``"(root)"``, or the patterns joined by ``"|"``).
        bounds: ``C_g`` per group, ``[G]``.
        index: the group of each trainable parameter, in the order of the names given to
            :func:`resolve_clipping_groups`.
    """

    spec: str | tuple[tuple[str, ...], ...]
    labels: tuple[str, ...]
    bounds: tuple[float, ...]
    index: tuple[int, ...]

    @property
    def sensitivity(self) -> float:
        """``sqrt(sum_g C_g^2)``, the l2 sensitivity of the clipped sum."""
        return sensitivity(self.bounds)

    def bounds_by_label(self) -> dict[str, float]:
        """``{label: C_g}`` in group order (the privacy summary's ``clipping_groups``)."""
        return dict(zip(self.labels, self.bounds, strict=True))

    def describe(self, limit: int = 6) -> str:
        """One start-up line: the number of groups, their bounds (elided past ``limit``) and the sensitivity."""
        items = [f"{label} {bound:.4g}" for label, bound in zip(self.labels, self.bounds, strict=True)]
        if len(items) > limit:
            items = [*items[: limit - 2], f"... ({len(items) - limit + 1} more)", items[-1]]
        spec = self.spec if isinstance(self.spec, str) else "patterns"
        return (
            f"{len(self.bounds)} group(s) ({spec}): {', '.join(items)}; sensitivity sqrt(sum C_g^2) = "
            f"{self.sensitivity:.4g}"
        )


def resolve_clipping_groups(
    clipping_groups: GroupsSpec, max_grad_norm: Bounds, names: Sequence[Sequence[str]]
) -> ClippingGroups:
    """The groups of a model's trainable parameters and their bounds.

    Args:
        clipping_groups: ``"per_layer"`` or pattern groups (not ``None``).
        max_grad_norm: one bound (``C / sqrt(G)`` per group) or one per group.
        names: per trainable parameter in ``named_parameters()`` order, its names (the first from
            ``named_parameters()``, then its other owners').

    Returns:
        The groups; :attr:`ClippingGroups.index` follows ``names``.

    Raises:
        ValueError: as :func:`validate_bounds` and :func:`validate_clipping_groups`; no trainable parameter; a
            parameter matched by no group or several; a group matching nothing; bounds of another length than the
            groups.
    """
    validate_bounds(max_grad_norm)
    validate_clipping_groups(clipping_groups, max_grad_norm)
    if clipping_groups is None:
        raise ValueError("resolve_clipping_groups needs clipping_groups (None is flat clipping)")
    if not names:
        raise ValueError("clipping_groups needs at least one trainable parameter")
    spec: str | tuple[tuple[str, ...], ...]
    if isinstance(clipping_groups, str):
        spec = clipping_groups
        labels: list[str] = []
        index = []
        for param_names in names:
            owner = param_names[0].rpartition(".")[0] or "(root)"
            if owner not in labels:
                labels.append(owner)
            index.append(labels.index(owner))
    else:
        patterns = _pattern_groups(clipping_groups)
        assert patterns is not None
        spec = tuple(patterns)
        labels = ["|".join(group) for group in patterns]
        index, unmatched, doubly = [], [], []
        for param_names in names:
            matched = sorted(
                {
                    g
                    for g, group in enumerate(patterns)
                    for name in param_names
                    for p in group
                    if fnmatch.fnmatchcase(name, p)
                }
            )
            if not matched:
                unmatched.append(param_names[0])
            elif len(matched) > 1:
                doubly.append(f"'{param_names[0]}' (groups {matched})")
            index.append(matched[0] if matched else -1)
        problems = []
        if unmatched:
            problems.append(f"matched by no group: {', '.join(repr(n) for n in unmatched)}")
        if doubly:
            problems.append(f"matched by several groups: {', '.join(doubly)}")
        empty = [f"{g} {list(group)}" for g, group in enumerate(patterns) if g not in index]
        if empty:
            problems.append(f"groups matching no trainable parameter: {', '.join(empty)}")
        if problems:
            raise ValueError(
                "clipping_groups must put every trainable parameter in exactly one group (fnmatch patterns on the "
                f"parameter names, any name of a tied parameter); {'; '.join(problems)}"
            )
    bounds = _bound_list(max_grad_norm)
    if bounds is None:
        bounds = [single_bound(max_grad_norm) / math.sqrt(len(labels))] * len(labels)
    elif len(bounds) != len(labels):
        listing = ", ".join(f"{g}: {label}" for g, label in enumerate(labels))
        raise ValueError(
            f"max_grad_norm has {len(bounds)} bounds but clipping_groups={clipping_groups!r} makes {len(labels)} "
            f"groups on this model, in order [{listing}]: give one bound per group in that order, or one number "
            "(split equally, C / sqrt(G) each)"
        )
    return ClippingGroups(spec=spec, labels=tuple(labels), bounds=tuple(bounds), index=tuple(index))


def check_grouped_clipping(*, norm: int, engine: str, randomized: bool, adaptive: bool = False) -> None:
    """Refuse the settings group-wise clipping does not support.

    Args:
        norm: the mechanism's clipping norm (1 or 2).
        engine: the engine's name; ``randomized``: whether it estimates norms randomly.
        adaptive: whether the bound adapts (``target_unclipped_quantile``).

    Raises:
        ValueError: ``norm=1``, a randomized engine, or adaptive clipping (docs/design.md section 4.7).
    """
    if norm == 1:
        raise ValueError(
            "clipping_groups needs an l2 mechanism: with l1 clipping (noise='laplace') the sensitivity would be the "
            "sum of the groups' bounds, which is not implemented; use an l2 mechanism (gaussian, lap2, plrv, "
            "laplace-advanced) or clipping_groups=None"
        )
    if randomized:
        raise ValueError(
            f"clipping_groups needs an exact clipping engine (auto, flat, ghost, fgc, mixed), got clipping={engine!r}: "
            "its norms are random estimates, and the rc accountant bounds one random scale of the whole clipped "
            "gradient, not one per group"
        )
    if adaptive:
        raise ValueError(
            "clipping_groups cannot be combined with adaptive clipping (target_unclipped_quantile), which moves one "
            "bound for the whole gradient: fix the groups' bounds (max_grad_norm), or use clipping_groups=None"
        )
