"""Noise calibration for a target (epsilon, delta), through the registry of mechanisms.

:func:`calibrate` / :func:`calibrate_result` find, at fixed ``C``, the noise parameter whose accountant epsilon after
``steps`` Poisson-subsampled steps lies in ``[(1 - rtol) target, target]`` (``rtol = 0.1 %``); each mechanism
calibrates itself (``NoiseMechanism.calibrate``), so a newly registered one is calibrated the same way.
:func:`search_lap2` (Mohammady et al. 2026, Alg. 1) and :func:`search_plrv` (Yang et al. 2025, Alg. 1) also search
the clipping bound (re-exported here).
"""

from __future__ import annotations

import logging

from lightning_dp.mechanisms.base import NoiseMechanism, mechanism_class, validate_max_grad_norm
from lightning_dp.mechanisms.gaussian import PLD_MIN_NOISE_MULTIPLIER
from lightning_dp.mechanisms.search_lap2 import Lap2Search, search_lap2
from lightning_dp.mechanisms.search_plrv import (
    PlrvSearch,
    corollary_d2_shape_bounds,
    gamma_scale_lower_bound,
    search_plrv,
)
from lightning_dp.mechanisms.solver import (
    RTOL,
    CalibrationProblem,
    CalibrationResult,
    _require_num_params,
    _validate_target,
    calibrate_parameter,
    closed_form_noise_ratio,
    mechanism_epsilon,
    solve_monotone,
)

log = logging.getLogger("lightning_dp")

__all__ = [
    "PLD_MIN_NOISE_MULTIPLIER",
    "RTOL",
    "CalibrationProblem",
    "CalibrationResult",
    "Lap2Search",
    "PlrvSearch",
    "calibrate",
    "calibrate_parameter",
    "calibrate_result",
    "closed_form_noise_ratio",
    "corollary_d2_shape_bounds",
    "gamma_scale_lower_bound",
    "mechanism_epsilon",
    "resolve_accountant",
    "search_lap2",
    "search_plrv",
    "solve_monotone",
    "warn_if_noise_drowns_the_signal",
]


def resolve_accountant(noise: str, accountant: str | None = None) -> str:
    """The accountant a calibration of ``noise`` targets: ``accountant``, else the class's ``calibration_accountant``,
    else its ``default_accountant`` (``laplace-advanced``: ``"advanced"`` here, the sound ``"lap2"`` in training).

    Raises:
        ValueError: unknown mechanism name.
    """
    cls = mechanism_class(noise)  # an unknown name fails here, with a suggestion
    if accountant is not None:
        return accountant
    return cls.calibration_accountant or cls.default_accountant


def calibrate(
    noise: str,
    *,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    max_grad_norm: float,
    num_params: int | None = None,
    accountant: str | None = None,
) -> NoiseMechanism:
    """A mechanism of kind ``noise`` with clipping bound ``max_grad_norm`` that meets ``(target_epsilon, delta)``.

    The noise parameter is chosen so the accountant's epsilon after ``steps`` steps lies within 0.1 % below the
    target (see :func:`calibrate_result`, which also returns that epsilon).
    """
    return calibrate_result(
        noise,
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        sample_rate=sample_rate,
        steps=steps,
        max_grad_norm=max_grad_norm,
        num_params=num_params,
        accountant=accountant,
    ).mechanism


def calibrate_result(
    noise: str,
    *,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    max_grad_norm: float,
    num_params: int | None = None,
    accountant: str | None = None,
    warn: bool = True,
) -> CalibrationResult:
    """Calibrate the noise parameter of ``noise`` for a fixed clipping bound ``C = max_grad_norm``.

    Per mechanism (default accountant): ``gaussian`` sigma (``"pld"``); ``laplace`` scale ``b`` from the closed form of
    basic composition, refined on the accountant (``"basic"``); ``laplace-advanced`` the advanced-composition scale
    (``"advanced"``), else root finding; ``lap2`` scale ``b`` (``"lap2"``, LAP2 Alg. 1 inner loop); ``plrv`` ``(k,
    theta)`` by :func:`search_plrv` with ``clip_range=(C, C)`` (``"plrv"``).

    Args:
        noise: a registered mechanism name.
        target_epsilon: target epsilon ``> 0``.
        target_delta: target delta in ``[0, 1)`` (``0`` only for pure-DP accounting).
        sample_rate: Poisson sampling rate ``q`` in ``(0, 1]``.
        steps: number of steps ``T``.
        max_grad_norm: clipping bound ``C`` (l1 for ``laplace``, l2 otherwise).
        num_params: noised coordinates ``n``, required by every class with ``needs_num_params``.
        accountant: accountant name (default: :func:`resolve_accountant`).
        warn: log :func:`warn_if_noise_drowns_the_signal`'s warning.

    Raises:
        ValueError: invalid arguments, an unsupported mechanism/accountant pair, or an unreachable target.
    """
    _validate_target(target_epsilon, target_delta, sample_rate, steps)
    validate_max_grad_norm(max_grad_norm)
    cls = mechanism_class(noise)
    name = resolve_accountant(noise, accountant)
    if cls.needs_num_params:
        num_params = _require_num_params(noise, num_params)
    problem = CalibrationProblem(
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        sample_rate=sample_rate,
        steps=steps,
        max_grad_norm=max_grad_norm,
        accountant=name,
        num_params=num_params,
    )
    result = cls.calibrate(problem)
    if warn:
        warn_if_noise_drowns_the_signal(result.mechanism, max_grad_norm)
    return result


#: Per-coordinate noise ``E|z|`` above this many clipping bounds gets a warning (about ``sigma = 50`` for Gaussian
#: noise, where ``E|z| = sigma C sqrt(2 / pi)``).
NOISE_TO_CLIP_WARNING = 40.0


def warn_if_noise_drowns_the_signal(mechanism: NoiseMechanism, max_grad_norm: float) -> bool:
    """Log a warning, and return True, when a calibrated mechanism's per-coordinate noise exceeds
    :data:`NOISE_TO_CLIP_WARNING` clipping bounds: every coordinate of a step's clipped sum is then buried under noise
    tens of times larger than one example's whole gradient, and training learns nothing useful."""
    ratio = mechanism.expected_abs_noise() / max_grad_norm
    if ratio <= NOISE_TO_CLIP_WARNING:
        return False
    log.warning(
        "The calibrated noise is %.3g times the clipping bound per coordinate (%s): training will learn nothing "
        "useful. Ask less of it: more data (a smaller sample rate at the same batch size), a larger batch with fewer "
        "steps, or a larger target epsilon",
        ratio,
        ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in mechanism.describe().items()),
    )
    return True
