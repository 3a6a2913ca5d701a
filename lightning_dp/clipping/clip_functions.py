"""Clip functions: the factor ``c_i`` that scales a unit's gradient in the clipped sum (docs/design.md section 4.11).

``"abadi"`` (default): ``c_i = min(1, C / (nu_i + 1e-6))`` (Abadi et al. 2016, Algorithm 1). ``"automatic"``: ``c_i =
C / (nu_i + gamma)`` (Bu et al. 2023, "Automatic Clipping: Differentially Private Deep Learning Made Easier and
Stronger", NeurIPS, Section 4, with fastDP's ``clipping_fn="automatic"`` and its stability constant ``gamma = 0.01``);
``gamma = 0`` is normalised SGD (Das et al. 2023). A ``gamma`` below ``1e-6`` counts as ``1e-6``, the standard factor's
constant: what underflow takes from a norm is absolute, and divided by ``nu_i`` alone could exceed ``C`` (docs/design.md
section 4.10). ``nu_i`` is the
rounding bound of section 4.10 (:func:`~.rounding.rounded_norm_bound`), the automatic factor never exceeds the
standard one's ``C / nu_i`` as computed, and the sensitivity ``C`` (per group ``C_g``) of the clipped sum is the same
for both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

#: The clip functions: ``"abadi"`` (``min(1, C / n)``) and ``"automatic"`` (``C / (n + gamma)``).
CLIPPING_FNS = ("abadi", "automatic")
#: Bu et al. 2023's stability constant gamma of automatic clipping, fastDP's default for ``clipping_fn="automatic"``.
DEFAULT_AUTOMATIC_CLIPPING_GAMMA = 0.01

_EPS = 1e-6


def validate_clipping_fn(clipping_fn: str, *, randomized: bool = False, adaptive: bool = False) -> None:
    """Refuse an unknown clip function, and automatic clipping with a randomized engine or adaptive clipping.

    Args:
        clipping_fn: one of :data:`CLIPPING_FNS`.
        randomized: whether the engine clips by a random norm estimate (``hutch``/``hutchpp``).
        adaptive: whether adaptive clipping (``target_unclipped_quantile``) is on.

    Raises:
        ValueError: ``clipping_fn`` not in :data:`CLIPPING_FNS`; ``"automatic"`` with a randomized engine, whose ``rc``
            accountant (DP-SGD-RC) accounts for the factor ``min(1, C / estimate)`` only, or with adaptive clipping,
            whose quantile of unclipped examples automatic clipping leaves nothing to track.
    """
    if clipping_fn not in CLIPPING_FNS:
        raise ValueError(f"clipping_fn must be one of {list(CLIPPING_FNS)}, got {clipping_fn!r}")
    if clipping_fn == "automatic" and randomized:
        raise ValueError(
            "clipping_fn='automatic' needs an exact clipping engine (auto, flat, ghost, fgc, mixed): the rc "
            "accountant of hutch/hutchpp accounts for the factor min(1, C / estimate) only"
        )
    if clipping_fn == "automatic" and adaptive:
        raise ValueError(
            "clipping_fn='automatic' scales every gradient to a norm just below C, so adaptive clipping's "
            "quantile of unclipped examples has nothing to track: remove target_unclipped_quantile or use "
            "clipping_fn='abadi'"
        )


def validate_automatic_clipping_gamma(gamma: float) -> None:
    """Refuse a ``gamma`` of automatic clipping that is not a finite number ``>= 0`` (gradient-norm units).

    Raises:
        ValueError: ``gamma`` negative, not finite or not a number.
    """
    if isinstance(gamma, bool) or not isinstance(gamma, int | float) or not math.isfinite(gamma) or gamma < 0:
        raise ValueError(
            f"automatic_clipping_gamma must be a finite number >= 0 (0: normalised SGD), got {gamma!r}; "
            f"Bu et al. 2023 use {DEFAULT_AUTOMATIC_CLIPPING_GAMMA}"
        )


def clip_factors(
    norms: torch.Tensor,
    bounds: Sequence[float],
    clipping_fn: str = "abadi",
    gamma: float = DEFAULT_AUTOMATIC_CLIPPING_GAMMA,
) -> torch.Tensor:
    """Clip factors ``c_gi`` ``[G, B]`` of the norm bounds ``nu_gi`` ``[G, B]`` (not negative, ``inf`` allowed) and the
    bounds ``C_g`` (groups: He et al. 2022, Section 3).

    ``"abadi"``: ``min(1, C_g / (nu_gi + 1e-6))`` (Abadi et al. 2016, Algorithm 1). ``"automatic"``: ``C_g / (nu_gi +
    max(gamma, 1e-6))`` (Bu et al. 2023, Section 4), where a factor that is not finite (a non-finite bound) is 0.
    Both are at most ``C_g / nu_gi`` as computed, so ``c_gi nu_gi <= C_g (1 + eps)`` (the factor's own rounding,
    within the margin of ``nu_gi``) holds for both alike (docs/design.md sections 4.10 and 4.11).
    """
    if clipping_fn == "automatic":
        floor = max(gamma, _EPS)
        return torch.stack(
            [(bound / (n + floor)).nan_to_num(nan=0.0, posinf=0.0) for bound, n in zip(bounds, norms, strict=True)]
        )
    return torch.stack([(bound / (n + _EPS)).clamp(max=1.0) for bound, n in zip(bounds, norms, strict=True)])
