"""The generic calibration machinery: the privacy target (:class:`CalibrationProblem`), the result type and the one
monotone root finder (:func:`solve_monotone`, serving every mechanism and the LAP2 / PLRV-O searches), after
dp-accounting's ``calibrate_dp_mechanism``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from scipy import optimize

from lightning_dp.accounting import epsilon_for

if TYPE_CHECKING:
    from lightning_dp.mechanisms.base import NoiseMechanism

#: Relative tolerance of every calibration: the achieved epsilon lies in ``[(1 - RTOL) target, target]``.
RTOL = 0.001


def mechanism_epsilon(
    mechanism: NoiseMechanism,
    *,
    sample_rate: float,
    steps: int,
    delta: float,
    num_params: int | None = None,
    accountant: str | None = None,
) -> float:
    """Epsilon of ``steps`` Poisson-subsampled steps of ``mechanism`` at ``delta``.

    Args:
        mechanism: the noise mechanism.
        sample_rate: Poisson sampling rate ``q = expected batch size / N``.
        steps: number of optimizer steps ``T``.
        delta: target delta (ignored by pure-DP accountants).
        num_params: number of noised coordinates ``n`` (required by the LAP2 / PLRV-O accountants).
        accountant: accountant name; defaults to ``mechanism.default_accountant``.

    Raises:
        ValueError: invalid arguments, or an accountant that does not support the mechanism's event.
    """
    _validate_common(sample_rate, steps)
    if num_params is None and mechanism.needs_num_params:
        raise ValueError(f"num_params (number of trainable parameters) is required for noise={mechanism.name!r}")
    event = mechanism.step_event(sample_rate, 1 if num_params is None else int(num_params))
    return epsilon_for(event, int(steps), delta, accountant or mechanism.default_accountant)


def _validate_common(sample_rate: float, steps: int) -> None:
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must lie in (0, 1] (expected batch size / dataset size), got {sample_rate}")
    if int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps}")


def _validate_target(target_epsilon: float, target_delta: float, sample_rate: float, steps: int) -> None:
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ValueError(f"target_epsilon must be a positive finite number, got {target_epsilon}")
    if not 0.0 <= target_delta < 1.0:
        raise ValueError(f"target_delta must lie in [0, 1), got {target_delta}; a typical choice is below 1/N")
    _validate_common(sample_rate, steps)


def _require_num_params(noise: str, num_params: int | None) -> int:
    if num_params is None or int(num_params) != num_params or num_params < 1:
        raise ValueError(
            f"noise={noise!r} needs num_params, the number of noised coordinates (trainable parameters), "
            f"as a positive integer; got {num_params}"
        )
    return int(num_params)


# ----------------------------------------------------------------------------------------------------------------
# The shared monotone root finder
# ----------------------------------------------------------------------------------------------------------------


class _WithinTolerance(Exception):
    """Raised inside the root finder to stop as soon as a point in the target window is found."""


def solve_monotone(
    epsilon_of: Callable[[float], float],
    target: float,
    *,
    initial: float,
    increasing: bool,
    rtol: float = RTOL,
    bounds: tuple[float, float] = (1e-12, 1e12),
    growth: float = 2.0,
) -> tuple[float, float]:
    """Find ``x > 0`` with ``(1 - rtol) target <= epsilon_of(x) <= target`` for an epsilon monotone in ``x``.

    Geometric bracketing from ``initial``, ``scipy.optimize.brentq`` on ``log(epsilon / target)`` over ``log x``, and
    bisection between the tightest safe and unsafe points when the root finder ends outside the window (step-like
    accountants, MGF poles). The returned point is always on the safe side (``epsilon <= target``).

    Args:
        epsilon_of: ``x -> epsilon`` (may return ``inf`` for parameters with no finite guarantee).
        target: target epsilon ``> 0``.
        initial: starting guess for ``x`` (e.g. a closed-form approximation).
        increasing: True if epsilon increases with ``x`` (PLRV-O ``theta``), False if it decreases (noise scales).
        rtol: relative width of the window below ``target``.
        bounds: the range ``x`` is searched in; if even the bound on the unsafe side meets the target, that bound
            is returned (e.g. the PLRV-O MGF cap).
        growth: factor by which the bracket grows per step.

    Returns:
        ``(x, epsilon_of(x))``.

    Raises:
        ValueError: no ``x`` within ``bounds`` reaches the target (the message gives the closest epsilon).
    """
    lo_bound, hi_bound = bounds
    xtol = rtol / 4  # in log x: lands in the window wherever |d log epsilon / d log x| <= 4 near the target
    sign = 1.0 if increasing else -1.0  # safe points lie at smaller sign * log(x)
    cache: dict[float, float] = {}

    def evaluate(t: float) -> float:
        if t not in cache:
            eps = float(epsilon_of(math.exp(t)))
            cache[t] = math.inf if math.isnan(eps) else eps
            if (1.0 - rtol) * target <= eps <= target:
                raise _WithinTolerance
        return cache[t]

    def signed(t: float) -> float:
        ratio = math.log(max(evaluate(t), 1e-300) / (target * (1.0 - rtol / 2)))
        return max(min(ratio, 50.0), -50.0)

    def bracket() -> tuple[float, float]:
        """The tightest safe and unsafe points evaluated so far (log x)."""
        safe = max((t for t, e in cache.items() if e <= target), key=lambda t: sign * t)
        unsafe = min((t for t, e in cache.items() if e > target), key=lambda t: sign * t)
        return safe, unsafe

    t_lo, t_hi = math.log(lo_bound), math.log(hi_bound)
    t0 = min(max(math.log(initial), t_lo), t_hi)
    try:
        first = signed(t0)
        direction = -sign if first > 0 else sign
        t = t0
        step = math.log(growth)
        while True:
            t = min(max(t + direction * step, t_lo), t_hi)
            step *= 1.5
            if (signed(t) > 0) != (first > 0):
                break
            if t in (t_lo, t_hi):
                if direction == sign:  # the whole range up to the bound is safe: the bound is the answer
                    return math.exp(t), cache[t]
                closest = min(cache.values(), key=lambda e: abs(e - target))
                raise ValueError(
                    f"No parameter in [{lo_bound:g}, {hi_bound:g}] reaches epsilon {target:g}; the closest was "
                    f"{closest:g}. Loosen the target (larger epsilon or delta, fewer steps, smaller sample rate)."
                )
        safe_t, unsafe_t = bracket()
        while math.isinf(cache[unsafe_t]) and abs(unsafe_t - safe_t) > xtol:  # no interpolation through inf
            evaluate(0.5 * (safe_t + unsafe_t))
            safe_t, unsafe_t = bracket()
        if abs(unsafe_t - safe_t) > xtol:
            optimize.brentq(signed, min(safe_t, unsafe_t), max(safe_t, unsafe_t), xtol=xtol, maxiter=100)
            safe_t, unsafe_t = bracket()
        while abs(unsafe_t - safe_t) > xtol:
            evaluate(0.5 * (safe_t + unsafe_t))
            safe_t, unsafe_t = bracket()
    except _WithinTolerance:
        pass
    t_best = max((t for t, e in cache.items() if e <= target), key=lambda t: cache[t])
    return math.exp(t_best), cache[t_best]


def closed_form_noise_ratio(target_epsilon: float, target_delta: float, sample_rate: float, steps: int) -> float:
    """LAP2 seed Sec. IV-B first-order estimate of ``b / C``: ``(2 q / eps) sqrt(T log(1/delta))``.

    Used as the starting point of every calibration (it is also the right order of magnitude for the Gaussian
    noise multiplier, by the same small-``q`` moments argument). ``delta = 0`` is treated as ``1e-10``.
    """
    log_inv_delta = math.log(1.0 / max(target_delta, 1e-10))
    return 2.0 * sample_rate / target_epsilon * math.sqrt(steps * log_inv_delta)


@dataclasses.dataclass(frozen=True)
class CalibrationResult:
    """A calibrated mechanism and the guarantee it achieves.

    Attributes:
        mechanism: the calibrated noise mechanism (pass it as ``DPStrategy(noise=...)``).
        epsilon: epsilon after ``steps`` steps at the target delta, under ``accountant``.
        accountant: the accountant the calibration targeted.
    """

    mechanism: NoiseMechanism
    epsilon: float
    accountant: str


@dataclasses.dataclass(frozen=True)
class CalibrationProblem:
    """What a calibration must meet, and how a candidate mechanism is scored.

    Attributes:
        target_epsilon: target epsilon ``> 0``.
        target_delta: target delta in ``[0, 1)``.
        sample_rate: Poisson rate ``q`` in ``(0, 1]``.
        steps: number of steps ``T``.
        max_grad_norm: the clipping bound ``C`` (fixed; the largest one considered by a clipping search).
        accountant: the accountant the calibration targets (already resolved, see ``resolve_accountant``).
        num_params: noised coordinates ``n`` (``None`` where the mechanism's event does not depend on it).
    """

    target_epsilon: float
    target_delta: float
    sample_rate: float
    steps: int
    max_grad_norm: float
    accountant: str
    num_params: int | None = None

    def epsilon_of(self, mechanism: NoiseMechanism) -> float:
        """Epsilon of ``steps`` steps of ``mechanism`` under the target accountant at the target delta (the
        ``make_fresh_accountant`` + ``make_event_from_param`` of dp-accounting's ``calibrate_dp_mechanism``, with the
        event coming from ``mechanism.step_event``)."""
        return mechanism_epsilon(
            mechanism,
            sample_rate=self.sample_rate,
            steps=self.steps,
            delta=self.target_delta,
            num_params=self.num_params,
            accountant=self.accountant,
        )

    def noise_ratio(self) -> float:
        """:func:`closed_form_noise_ratio` of this target and schedule (a first guess for ``sigma`` or ``b / C``)."""
        return closed_form_noise_ratio(self.target_epsilon, self.target_delta, self.sample_rate, self.steps)


def calibrate_parameter(mechanism_class: type[NoiseMechanism], problem: CalibrationProblem) -> CalibrationResult:
    """Calibrate the one parameter ``mechanism_class.calibrated_parameter`` at fixed ``C`` for ``problem``.

    The class supplies ``from_parameter``, ``calibration_start``, ``epsilon_increases`` and ``parameter_bounds``;
    :func:`solve_monotone` finds the value whose epsilon lies in ``[(1 - RTOL) target, target]``.

    Raises:
        ValueError: an unreachable target (see :func:`solve_monotone`).
    """
    initial, growth = mechanism_class.calibration_start(problem)

    def build(value: float) -> NoiseMechanism:
        return mechanism_class.from_parameter(value, max_grad_norm=problem.max_grad_norm)

    value, eps = solve_monotone(
        lambda value: problem.epsilon_of(build(value)),
        problem.target_epsilon,
        initial=initial,
        increasing=mechanism_class.epsilon_increases,
        bounds=mechanism_class.parameter_bounds,
        growth=growth,
    )
    return CalibrationResult(build(value), eps, problem.accountant)
