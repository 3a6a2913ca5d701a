"""Noise calibration for DP-SGD with randomized clipping (Hutch / Hutch++ norms; seed ``dpsgd-rc``, Sec. 5.2).

The noise is the plain Gaussian mechanism; only the accountant differs (``rc``, which bounds the random
sensitivity ``C / sqrt(Y)``), so the result is a :class:`~lightning_dp.mechanisms.gaussian.GaussianMechanism`
whose ``noise_multiplier`` meets the target under ``rc``. The search reuses the shared monotone root finder of
:mod:`lightning_dp.mechanisms.calibration` (scipy ``brentq``), started from the deterministic-clipping sigma
(``pld`` accountant), which the ``rc`` sigma always exceeds.
"""

from __future__ import annotations

from typing import cast

from lightning_dp.accounting import epsilon_for
from lightning_dp.accounting.rc import randomized_clipping_step_event
from lightning_dp.mechanisms.calibration import calibrate_result, warn_if_noise_drowns_the_signal
from lightning_dp.mechanisms.gaussian import GaussianMechanism
from lightning_dp.mechanisms.solver import CalibrationResult, _validate_target, solve_monotone


def randomized_clipping_epsilon(
    noise_multiplier: float,
    *,
    target_delta: float,
    sample_rate: float,
    steps: int,
    projection_dim: int,
    norm_dim: int,
    estimator: str = "hutch",
) -> float:
    """Epsilon (``rc`` accountant) after ``steps`` Poisson-subsampled DP-SGD-RC steps at ``target_delta``.

    Raises:
        ValueError: invalid arguments (see :func:`~lightning_dp.accounting.rc.randomized_clipping_step_event`).
    """
    event = randomized_clipping_step_event(noise_multiplier, sample_rate, projection_dim, norm_dim, estimator)
    return epsilon_for(event, int(steps), target_delta, "rc")


def calibrate_randomized_clipping(
    *,
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    projection_dim: int,
    norm_dim: int,
    estimator: str = "hutch",
    max_grad_norm: float = 1.0,
) -> CalibrationResult:
    """The Gaussian noise multiplier for DP-SGD-RC that meets ``(target_epsilon, target_delta)``.

    The ``rc`` epsilon after ``steps`` steps lies in ``[(1 - 1 %) target, target]`` (the shared tolerance
    ``calibration.RTOL``).

    Args:
        target_epsilon: target epsilon ``> 0``.
        target_delta: target delta in ``(0, 1)``.
        sample_rate: Poisson rate ``q`` in ``(0, 1]``.
        steps: number of optimizer steps ``T >= 1``.
        projection_dim: k, projection columns of the norm estimator (seed default 32).
        norm_dim: d, largest unprojected layer dimension (recorded in the event; the bound holds for every d).
        estimator: ``"hutch"`` or ``"hutchpp"``.
        max_grad_norm: clipping bound ``C`` of the returned mechanism (does not change sigma).

    Returns:
        ``CalibrationResult(GaussianMechanism(sigma, C), epsilon, "rc")``.

    Raises:
        ValueError: invalid arguments, or no sigma in ``[1e-3, 1e4]`` reaches the target.
    """
    _validate_target(target_epsilon, target_delta, sample_rate, steps)
    pld = calibrate_result(
        "gaussian",
        target_epsilon=target_epsilon,
        max_grad_norm=max_grad_norm,
        accountant="pld",
        warn=False,
        target_delta=target_delta,
        sample_rate=sample_rate,
        steps=steps,
    ).mechanism
    deterministic = cast(GaussianMechanism, pld).noise_multiplier

    def epsilon_of(sigma: float) -> float:
        return randomized_clipping_epsilon(
            sigma,
            target_delta=target_delta,
            sample_rate=sample_rate,
            steps=steps,
            projection_dim=projection_dim,
            norm_dim=norm_dim,
            estimator=estimator,
        )

    sigma, epsilon = solve_monotone(
        epsilon_of, target_epsilon, initial=1.03 * deterministic, increasing=False, bounds=(1e-3, 1e4), growth=1.05
    )
    mechanism = GaussianMechanism(sigma, max_grad_norm)
    warn_if_noise_drowns_the_signal(mechanism, max_grad_norm)
    return CalibrationResult(mechanism, epsilon, "rc")
