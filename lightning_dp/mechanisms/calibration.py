"""Noise calibration for a target (epsilon, delta), and the LAP2 / PLRV-O parameter searches.

- :func:`calibrate`: fixed clipping bound ``C``; find the noise parameter whose accountant epsilon after ``steps``
  Poisson-subsampled steps lies in ``[(1 - rtol) target, target]`` (``rtol = 1 %``). One monotone root finder,
  :func:`solve_monotone` (scipy ``brentq`` in log-parameter space, keeping the best point on the safe side), serves
  every mechanism.
- :func:`search_lap2`: LAP2 seed, Alg. 1 -- the largest ``C`` with its smallest feasible Laplace scale ``b``, started
  from the closed form of Sec. IV-B, ``b* ~ (2 q / eps) sqrt(T log(1/delta)) C``.
- :func:`search_plrv`: PLRV-O seed, Alg. 1 -- maximise ``C (k - 1) theta`` subject to constraints c0-c4, with
  the closed-form search-space bounds of Appendix D.2 / Corollary D.2.

The accountants are looked up by name (``make_accountant``); the mechanism's ``default_accountant`` is used when
none is given, except for ``laplace-advanced`` whose calibration is, by definition, the literature review's
advanced-composition formula (accountant ``"advanced"``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
from scipy import optimize, special

from lightning_dp.accounting import epsilon_for
from lightning_dp.accounting.composition import advanced_laplace_noise_scale, basic_laplace_noise_scale
from lightning_dp.mechanisms.base import (
    MECHANISMS,
    NoiseMechanism,
    make_mechanism,
    mechanism_class,
    validate_max_grad_norm,
)
from lightning_dp.mechanisms.gaussian import GaussianMechanism
from lightning_dp.mechanisms.lap2 import Lap2Mechanism
from lightning_dp.mechanisms.plrv import PlrvMechanism

#: Relative tolerance of every calibration: the achieved epsilon lies in ``[(1 - RTOL) target, target]``.
RTOL = 0.01

#: Smallest Gaussian noise multiplier calibrated with the PLD accountant. The PLD grid of dp-accounting grows as sigma
#: falls (measured at q = 0.01, T = 1000 on one core: sigma 0.5 -> 3.6 s, 0.3 -> 7 s, 0.1 -> 99 s and 2.3 GB), while
#: such noise already means epsilon in the tens or more; below it :func:`calibrate_result` stops with a clear error
#: (the cheap RDP warm start tells within seconds).
PLD_MIN_NOISE_MULTIPLIER = 0.3


# ----------------------------------------------------------------------------------------------------------------
# Accounting helpers
# ----------------------------------------------------------------------------------------------------------------


def resolve_accountant(noise: str, accountant: str | None = None) -> str:
    """The accountant a calibration of ``noise`` targets: ``accountant`` if given, else the mechanism's default.

    ``laplace-advanced`` defaults to ``"advanced"`` here (its noise scale is defined by the literature review's
    advanced composition, section 4.4), while its training-time default stays the sound ``"lap2"``.

    Raises:
        ValueError: unknown mechanism name.
    """
    default = mechanism_class(noise).default_accountant  # an unknown name fails here, with a suggestion
    if accountant is not None:
        return accountant
    return "advanced" if noise == "laplace-advanced" else default


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
    if num_params is None and isinstance(mechanism, (Lap2Mechanism, PlrvMechanism)):
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

    The bracket is grown geometrically (factor ``growth``) from ``initial``; ``scipy.optimize.brentq`` then runs on
    ``log(epsilon / target)`` over ``log x``. Every evaluated point on the safe side (``epsilon <= target``) is
    remembered, the search stops at the first one inside the window, and if the root finder ends without one
    (a step-like accountant, or a jump to ``inf``/``nan`` at a moment-generating-function pole) plain bisection
    between the tightest safe and unsafe points runs until they agree to a relative ``1e-3`` in ``x``. The returned
    point is always on the safe side.

    Args:
        epsilon_of: ``x -> epsilon`` (may return ``inf`` for parameters with no finite guarantee).
        target: target epsilon ``> 0``.
        initial: starting guess for ``x`` (e.g. a closed-form approximation).
        increasing: True if epsilon increases with ``x`` (PLRV-O ``theta``), False if it decreases (noise scales).
        rtol: relative width of the window below ``target``.
        bounds: the range ``x`` is searched in; if even the bound on the unsafe side meets the target, that bound
            is returned (e.g. a parameter cap such as the PLRV-O MGF constraint).
        growth: factor by which the bracket grows per step (use a small one, e.g. 1.25, with a good ``initial``).

    Returns:
        ``(x, epsilon_of(x))``.

    Raises:
        ValueError: no ``x`` within ``bounds`` reaches the target (the message gives the closest epsilon).
    """
    lo_bound, hi_bound = bounds
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
        while math.isinf(cache[unsafe_t]) and abs(unsafe_t - safe_t) > 1e-3:  # no interpolation through inf
            evaluate(0.5 * (safe_t + unsafe_t))
            safe_t, unsafe_t = bracket()
        if abs(unsafe_t - safe_t) > 1e-3:
            optimize.brentq(signed, min(safe_t, unsafe_t), max(safe_t, unsafe_t), xtol=1e-3, maxiter=100)
            safe_t, unsafe_t = bracket()
        while abs(unsafe_t - safe_t) > 1e-3:
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


# ----------------------------------------------------------------------------------------------------------------
# calibrate
# ----------------------------------------------------------------------------------------------------------------


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

    The noise parameter is chosen so the accountant's epsilon after ``steps`` steps lies within 1 % below the
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
) -> CalibrationResult:
    """Calibrate the noise parameter of ``noise`` for a fixed clipping bound ``C = max_grad_norm``.

    Per mechanism:

    - ``gaussian``: noise multiplier ``sigma`` (root finding on the accountant, default ``"pld"``).
    - ``laplace``: scale ``b``; closed form of literature review 3.3 (``b = C T / eps`` for ``q = 1``; with the
      subsampling amplification inverted otherwise, ``basic_laplace_noise_scale``), checked and refined on the
      accountant (default ``"basic"``).
    - ``laplace-advanced``: with the default ``"advanced"`` accountant, the literature review 4.4 scale
      (``advanced_laplace_noise_scale``, which also guards the review's per-step formula where it is not valid for
      Laplace noise); with any other accountant (e.g. the sound ``"lap2"``), root finding on it.
    - ``lap2``: scale ``b`` at fixed ``C`` (LAP2 Alg. 1 inner loop; default ``"lap2"``).
    - ``plrv``: ``(k, theta)`` maximising ``(k - 1) theta`` under c1-c4 at fixed ``C`` (:func:`search_plrv` with
      ``clip_range=(C, C)``; default ``"plrv"``).

    Args:
        noise: mechanism name (``gaussian``, ``laplace``, ``laplace-advanced``, ``lap2``, ``plrv``).
        target_epsilon: target epsilon ``> 0``.
        target_delta: target delta in ``[0, 1)`` (``0`` only for pure-DP accounting).
        sample_rate: Poisson sampling rate ``q`` in ``(0, 1]``.
        steps: number of steps ``T``.
        max_grad_norm: clipping bound ``C`` (l1 for ``laplace``, l2 otherwise).
        num_params: noised coordinates ``n``, required for ``laplace-advanced``, ``lap2``, ``plrv``.
        accountant: accountant name (see :func:`resolve_accountant` for the default).

    Raises:
        ValueError: invalid arguments, an unsupported mechanism/accountant pair, or an unreachable target.
    """
    _validate_target(target_epsilon, target_delta, sample_rate, steps)
    validate_max_grad_norm(max_grad_norm)
    name = resolve_accountant(noise, accountant)
    ratio0 = closed_form_noise_ratio(target_epsilon, target_delta, sample_rate, steps)

    if noise == "plrv":
        found = search_plrv(
            target_epsilon,
            target_delta,
            sample_rate,
            steps,
            _require_num_params(noise, num_params),
            accountant=name,
            clip_range=(max_grad_norm, max_grad_norm),
        )
        return CalibrationResult(found.mechanism(), found.epsilon, name)

    growth = 2.0
    if noise == "gaussian":
        build: Callable[[float], NoiseMechanism] = lambda s: GaussianMechanism(s, max_grad_norm)  # noqa: E731
        initial = ratio0
        if name != "rdp":  # warm start from the cheap RDP bound (its sigma is a few % above PLD's)
            rdp = calibrate_result(
                "gaussian",
                target_epsilon=target_epsilon,
                target_delta=target_delta,
                sample_rate=sample_rate,
                steps=steps,
                max_grad_norm=max_grad_norm,
                accountant="rdp",
            )
            initial, growth = 0.97 * rdp.mechanism.noise_multiplier, 1.05
            if name == "pld" and rdp.mechanism.noise_multiplier < PLD_MIN_NOISE_MULTIPLIER:
                raise ValueError(
                    f"target_epsilon={target_epsilon:g} needs a noise multiplier of about "
                    f"{rdp.mechanism.noise_multiplier:.3g} (RDP estimate), below {PLD_MIN_NOISE_MULTIPLIER}: such "
                    "little noise gives no meaningful privacy, and the PLD accountant's grid would grow to minutes "
                    "and gigabytes. Lower the target (epsilon <= 10 is typical), or calibrate with accountant='rdp' "
                    "(sound, a few % looser, cheap at any noise)"
                )
    elif noise == "laplace":
        build = lambda b: make_mechanism("laplace", noise_scale=b, max_grad_norm=max_grad_norm)  # noqa: E731
        initial = basic_laplace_noise_scale(target_epsilon, steps, max_grad_norm, sample_rate)[1]
    elif noise in ("lap2", "laplace-advanced"):
        n = _require_num_params(noise, num_params)
        build = lambda b: make_mechanism(noise, noise_scale=b, max_grad_norm=max_grad_norm)  # noqa: E731
        initial = ratio0 * max_grad_norm
        if noise == "laplace-advanced" and name == "advanced":
            scale = advanced_laplace_noise_scale(target_epsilon, target_delta, steps, max_grad_norm, sample_rate)[2]
            mech = build(scale)
            eps = mechanism_epsilon(
                mech, sample_rate=sample_rate, steps=steps, delta=target_delta, num_params=n, accountant=name
            )
            return CalibrationResult(mech, eps, name)
    else:
        raise ValueError(f"No calibration for noise={noise!r}; choose one of {sorted(MECHANISMS)}")

    def epsilon_of(value: float) -> float:
        return mechanism_epsilon(
            build(value),
            sample_rate=sample_rate,
            steps=steps,
            delta=target_delta,
            num_params=num_params,
            accountant=name,
        )

    value, eps = solve_monotone(epsilon_of, target_epsilon, initial=initial, increasing=False, growth=growth)
    return CalibrationResult(build(value), eps, name)


# ----------------------------------------------------------------------------------------------------------------
# LAP2 Alg. 1
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Lap2Search:
    """Result of :func:`search_lap2` (LAP2 seed, Alg. 1).

    Attributes:
        max_grad_norm: the largest feasible l2 clipping bound ``C*``.
        noise_scale: the smallest feasible Laplace scale ``b*`` at ``C*``.
        epsilon: the achieved epsilon (``<= target``) under ``accountant``.
        accountant: the accountant name.
        initial_noise_scale: the closed-form initialiser ``(2 q / eps) sqrt(T log(1/delta)) C*`` (Sec. IV-B).
    """

    max_grad_norm: float
    noise_scale: float
    epsilon: float
    accountant: str
    initial_noise_scale: float

    @property
    def snr(self) -> float:
        """Per-step signal-to-noise ratio ``C / b`` (Sec. IV-C), the quantity Alg. 1 maximises."""
        return self.max_grad_norm / self.noise_scale

    def mechanism(self) -> Lap2Mechanism:
        """The ``lap2`` mechanism with ``(b*, C*)``."""
        return Lap2Mechanism(self.noise_scale, self.max_grad_norm)


def search_lap2(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    num_params: int,
    accountant: str = "lap2",
    *,
    max_clip: float = 1.0,
    max_noise_scale: float | None = None,
) -> Lap2Search:
    """LAP2 Alg. 1: the largest ``C <= max_clip`` whose smallest feasible ``b`` is at most ``max_noise_scale``.

    Alg. 1 scans ``C`` upwards and bisects ``b`` for each. Both LAP2 accountants depend on ``(C, b)`` only through
    ``C / b`` (eq. III.8 has ``x_i / b`` with ``x_i`` proportional to ``C``; the sound one uses ``C / sqrt(n)``), so
    the smallest feasible ``b`` is linear in ``C`` and the scan collapses: one root finding for ``b`` at
    ``C = max_clip`` (started at the Sec. IV-B closed form), then, if that ``b`` exceeds ``max_noise_scale``,
    ``C* = max_clip * max_noise_scale / b`` and ``b* = max_noise_scale``. The result is re-checked with the
    accountant at ``(C*, b*)``.

    Args:
        target_epsilon: target epsilon.
        target_delta: target delta in ``(0, 1)``.
        sample_rate: Poisson rate ``q``.
        steps: steps ``T``.
        num_params: noised coordinates ``n`` (any size: the search costs a few dozen accountant calls).
        accountant: ``"lap2"`` (sound, default) or ``"lap2-paper"``.
        max_clip: ``C_max`` of Alg. 1.
        max_noise_scale: ``b_max`` of Alg. 1 (``None``: unbounded, so ``C* = C_max``).

    Raises:
        ValueError: invalid arguments or an unreachable target.
    """
    _validate_target(target_epsilon, target_delta, sample_rate, steps)
    validate_max_grad_norm(max_clip)
    n = _require_num_params("lap2", num_params)

    def epsilon_at(clip: float, scale: float) -> float:
        return mechanism_epsilon(
            Lap2Mechanism(scale, clip),
            sample_rate=sample_rate,
            steps=steps,
            delta=target_delta,
            num_params=n,
            accountant=accountant,
        )

    ratio0 = closed_form_noise_ratio(target_epsilon, target_delta, sample_rate, steps)
    scale, eps = solve_monotone(
        lambda b: epsilon_at(max_clip, b), target_epsilon, initial=ratio0 * max_clip, increasing=False
    )
    clip = max_clip
    if max_noise_scale is not None and scale > max_noise_scale:
        clip, scale = max_clip * max_noise_scale / scale, float(max_noise_scale)
        eps = epsilon_at(clip, scale)
        if eps > target_epsilon:
            raise ValueError(
                f"The accountant {accountant!r} is not scale-invariant in (C, b): epsilon {eps:g} at the rescaled "
                f"point exceeds the target {target_epsilon:g}"
            )
    return Lap2Search(clip, scale, eps, accountant, ratio0 * clip)


# ----------------------------------------------------------------------------------------------------------------
# PLRV-O Alg. 1
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PlrvSearch:
    """Result of :func:`search_plrv` (PLRV-O seed, Alg. 1).

    Attributes:
        gamma_shape: ``k*``.
        gamma_scale: ``theta*``.
        max_grad_norm: ``C*``.
        epsilon: achieved epsilon (``<= target``) under ``accountant``.
        accountant: accountant name.
        gamma_cdf: ``GammaCDF(0.1; k*, theta*)`` (constraint c1, must be ``<= gamma_cdf_tol``).
        max_order: the moment order ``lambda_max`` the MGF must exist for (constraint ``(lambda_max+1) C theta < 1``).
        shape_bounds: Corollary D.2's closed-form ``[k_lo, k_hi]`` at ``(C*, theta*, lambda_max)``, or ``None``
            when its per-order intervals do not intersect (diagnostic only, see :func:`corollary_d2_shape_bounds`).
    """

    gamma_shape: float
    gamma_scale: float
    max_grad_norm: float
    epsilon: float
    accountant: str
    gamma_cdf: float
    max_order: int
    shape_bounds: tuple[float, float] | None

    @property
    def distortion(self) -> float:
        """Expected per-coordinate ``E|z| = 1 / ((k - 1) theta)`` (Thm 5.1)."""
        return 1.0 / ((self.gamma_shape - 1.0) * self.gamma_scale)

    @property
    def snr(self) -> float:
        """The objective ``J = C (k - 1) theta`` of Alg. 1."""
        return self.max_grad_norm * (self.gamma_shape - 1.0) * self.gamma_scale

    def mechanism(self) -> PlrvMechanism:
        """The ``plrv`` mechanism with ``(k*, theta*, C*)``."""
        return PlrvMechanism(self.gamma_shape, self.gamma_scale, self.max_grad_norm)


def gamma_scale_lower_bound(gamma_shape: float, *, gamma_cdf_tol: float, max_distortion: float) -> float:
    """Smallest ``theta`` allowed by c1 and c4 for shape ``k`` (PLRV-O Appendix D.2, ``max{theta_min(k), 0.1/(k-1)}``).

    - c1: ``GammaCDF(0.1; k, theta) = P(k, 0.1 / theta) <= gamma_cdf_tol``, i.e.
      ``theta >= 0.1 / P^{-1}(k, gamma_cdf_tol)`` (regularised lower incomplete Gamma ``P``).
    - c4: ``E|z| = 1 / ((k - 1) theta) <= max_distortion`` (the paper's ``theta >= 0.1/(k-1)`` for 10).
    """
    c1 = 0.1 / float(special.gammaincinv(gamma_shape, gamma_cdf_tol))
    c4 = 1.0 / (max_distortion * (gamma_shape - 1.0))
    return max(c1, c4)


def corollary_d2_shape_bounds(max_grad_norm: float, gamma_scale: float, max_order: int) -> tuple[float, float] | None:
    """PLRV-O Corollary D.2: the closed-form interval of ``k`` for given ``(C, theta, lambda_max)``.

    For every order ``eta = 2 .. lambda_max + 1`` the corollary gives the roots
    ``k_{1,2} = (4 log(1 - C theta (eta - 1)) -+ sqrt(Delta)) / (2 C^2 theta^2 (eta - eta^2))`` with
    ``Delta = 16 log^2(1 - C theta (eta - 1)) + 11.09375 C^2 theta^2 (eta - eta^2)``, valid for
    ``theta < 1 / (C (lambda_max + 1))``; ``k`` must lie between the roots (taken in increasing order, since the
    denominator is negative) for every ``eta``. The corollary relaxes a Gaussian-comparison criterion, and for the
    paper's own Table 2 configurations ``Delta < 0`` at ``eta = 2, 3`` (empty intersection), so the search uses the
    Appendix D.2 ``theta`` bounds (:func:`gamma_scale_lower_bound`, the MGF cap) as constraints and reports these
    ``k`` bounds as a diagnostic.

    Returns:
        ``(k_lo, k_hi)``, or ``None`` when the intersection over orders is empty or ``theta`` violates the MGF cap.
    """
    c_theta = max_grad_norm * gamma_scale
    if c_theta * (max_order + 1) >= 1.0:
        return None
    eta = np.arange(2, max_order + 2, dtype=float)
    log_term = np.log1p(-c_theta * (eta - 1.0))
    denom = c_theta**2 * (eta - eta**2)
    disc = 16.0 * log_term**2 + 11.09375 * denom
    if np.any(disc < 0):
        return None
    roots = np.stack(
        [(4.0 * log_term - np.sqrt(disc)) / (2.0 * denom), (4.0 * log_term + np.sqrt(disc)) / (2.0 * denom)]
    )
    lo, hi = float(roots.min(axis=0).max()), float(roots.max(axis=0).min())
    return (lo, hi) if lo <= hi else None


def search_plrv(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    num_params: int,
    accountant: str = "plrv",
    *,
    clip_range: tuple[float, float] = (0.1, 1.0),
    gamma_cdf_tol: float = 0.01,
    max_distortion: float = 10.0,
    max_order: int | None = None,
    shape_range: tuple[float, float] = (1.001, 1e6),
) -> PlrvSearch:
    """PLRV-O Alg. 1: maximise ``J = C (k - 1) theta`` subject to c0-c4.

    Constraints (Sec. 5.1, Appendix D.2):

    - c0: ``C_min <= C <= C_max`` (``clip_range``);
    - c1: ``GammaCDF(0.1; k, theta) <= gamma_cdf_tol`` (the paper's "approximately 0": scales ``b = 1/u > 10``
      are rare);
    - c2: ``epsilon(k, theta, C) <= target`` under ``accountant`` (Alg. 2 / the sound variant);
    - c3: ``k > 1`` (``shape_range``);
    - c4: ``E|z| = 1 / ((k-1) theta) <= max_distortion`` (the paper's ``theta >= 0.1/(k-1)``);
    - MGF validity: ``(lambda_max + 1) C theta < 1``; by default ``lambda_max = ceil(log(1/delta) / eps)``, the
      smallest order whose conversion term ``log(1/delta)/lambda`` can fit under the target.

    Solution: the accountant depends on ``(C, theta)`` only through ``C theta`` (Thm 4.8: the Gamma MGF is
    evaluated at ``(eta-1) C`` and ``-eta C``), and so does ``J = (k - 1) (C theta)``; only c1/c4 depend on
    ``theta`` alone. So for each ``k`` the largest feasible ``phi = C theta`` is found by root finding at
    ``C = C_max`` (c2 and the MGF cap), ``J(k) = (k-1) phi(k)`` is maximised over ``log(k-1)`` with
    ``scipy.optimize.minimize_scalar`` (bounded, after a coarse grid over the shapes not excluded in closed form by
    the Appendix D.2 bounds ``max{theta_min(k), 0.1/(k-1)} <= theta <= phi_cap / C_min``), and ``C*`` is the
    largest clip in ``clip_range`` for which ``theta = phi / C`` satisfies c1 and c4 (ties in ``J`` go to the
    larger clip, as in LAP2 Alg. 1). The result is re-checked with the accountant at ``(k*, theta*, C*)``.
    ``J(k)`` is often flat for large ``k`` (``k -> inf`` is the LAP2 limit ``u = k theta``); there any returned
    ``k`` is one of many optima equivalent within the 1 % calibration window.

    Args:
        target_epsilon, target_delta, sample_rate, steps: the privacy target and training schedule.
        num_params: noised coordinates ``n``.
        accountant: ``"plrv"`` (sound, default) or ``"plrv-paper"``.
        clip_range: ``(C_min, C_max)`` of c0; use ``(C, C)`` for a fixed clip.
        gamma_cdf_tol: the c1 tolerance.
        max_distortion: the c4 cap on ``E|z|``.
        max_order: ``lambda_max`` of the MGF constraint (see above for the default).
        shape_range: the ``k`` interval searched (``k > 1``).

    Raises:
        ValueError: invalid arguments, or no feasible point (the message says which constraint binds).
    """
    _validate_target(target_epsilon, target_delta, sample_rate, steps)
    n = _require_num_params("plrv", num_params)
    if not target_delta > 0:
        raise ValueError("search_plrv needs target_delta > 0: the PLRV-O accountants give (epsilon, delta)-DP")
    c_min, c_max = (float(c) for c in clip_range)
    validate_max_grad_norm(c_min)
    if c_max < c_min:
        raise ValueError(f"clip_range must be (C_min, C_max) with C_min <= C_max, got {clip_range}")
    k_lo, k_hi = (float(k) for k in shape_range)
    if not 1.0 < k_lo < k_hi:
        raise ValueError(f"shape_range must satisfy 1 < k_min < k_max (constraint c3), got {shape_range}")
    if max_order is None:
        max_order = math.ceil(math.log(1.0 / target_delta) / target_epsilon)
    phi_cap = (1.0 - 1e-9) / (max_order + 1)  # MGF validity: (lambda_max + 1) C theta < 1

    def epsilon_at(k: float, theta: float, clip: float) -> float:
        return mechanism_epsilon(
            PlrvMechanism(k, theta, clip),
            sample_rate=sample_rate,
            steps=steps,
            delta=target_delta,
            num_params=n,
            accountant=accountant,
        )

    # Laplace limit (k -> inf, u -> k theta = 1/b) of the closed-form initialiser: phi0 ~ C / b* = 1 / ratio0
    phi0 = 1.0 / closed_form_noise_ratio(target_epsilon, target_delta, sample_rate, steps)
    phi_cache: dict[float, tuple[float, float]] = {}

    def best_phi(k: float) -> tuple[float, float]:
        """Largest ``phi = C theta`` meeting c2 and the MGF cap at shape ``k``, and its epsilon."""
        if k not in phi_cache:
            if phi_cache:  # warm start: J = (k - 1) phi varies slowly with k, so reuse the nearest shape's J
                near = min(phi_cache, key=lambda kk: abs(math.log((kk - 1.0) / (k - 1.0))))
                initial, growth = (near - 1.0) * phi_cache[near][0] / (k - 1.0), 1.25
            else:
                initial, growth = phi0 / k, 4.0
            theta, eps = solve_monotone(
                lambda th: epsilon_at(k, th, c_max),
                target_epsilon,
                initial=min(initial, phi_cap) / c_max,
                increasing=True,
                bounds=(1e-14, phi_cap / c_max),
                growth=growth,
            )
            phi_cache[k] = (theta * c_max, eps)
        return phi_cache[k]

    def clip_for(k: float, phi: float) -> float | None:
        """Largest ``C`` in ``clip_range`` with ``theta = phi / C`` meeting c1 and c4, or None."""
        theta_min = gamma_scale_lower_bound(k, gamma_cdf_tol=gamma_cdf_tol, max_distortion=max_distortion)
        clip = min(c_max, phi / theta_min)
        return clip if clip >= c_min else None

    def shape_of(log_km1: float) -> float:
        k = 1.0 + math.exp(log_km1)
        for edge in (k_lo, k_hi):  # undo exp(log(.)) rounding at the edges of shape_range
            if math.isclose(k, edge, rel_tol=1e-12):
                return edge
        return min(max(k, k_lo), k_hi)

    feasible: dict[float, tuple[float, float]] = {}  # shape -> (phi, clip) for shapes meeting c0-c4

    def neg_objective(log_km1: float) -> float:
        k = shape_of(log_km1)
        phi, _ = best_phi(k)
        clip = clip_for(k, phi)
        if clip is None:  # c1/c4 fail for every clip: +J, so that any feasible shape beats it
            return (k - 1.0) * phi
        feasible[k] = (phi, clip)
        return -(k - 1.0) * phi

    def infeasible(reason: str) -> ValueError:
        return ValueError(
            f"No PLRV-O configuration in shape_range={shape_range}, clip_range={clip_range} meets c1 "
            f"(GammaCDF(0.1) <= {gamma_cdf_tol}) and c4 (E|z| <= {max_distortion}) at epsilon {target_epsilon}: "
            f"{reason}. Use a smaller clip_range, a larger target epsilon, or relax gamma_cdf_tol / max_distortion."
        )

    # Appendix D.2 closed-form pruning, no accountant call: theta <= phi_cap / C_min, so shapes whose c1/c4 lower
    # bound on theta exceeds that can never be feasible; the bound decreases in k, so they form an interval [1, k_a).
    def slack(log_km1: float) -> float:
        theta_min = gamma_scale_lower_bound(
            shape_of(log_km1), gamma_cdf_tol=gamma_cdf_tol, max_distortion=max_distortion
        )
        return math.log(phi_cap / (c_min * theta_min))

    s_lo, s_hi = math.log(k_lo - 1.0), math.log(k_hi - 1.0)
    if slack(s_hi) < 0:
        raise infeasible("even the MGF cap on C*theta leaves theta below the c1/c4 bound at every shape")
    if slack(s_lo) < 0:
        s_lo = optimize.brentq(slack, s_lo, s_hi, xtol=1e-6)
    grid = np.linspace(s_lo, s_hi, 7)
    values = [neg_objective(float(g)) for g in grid]
    if not feasible:
        raise infeasible("the privacy constraint forces theta too small")
    i = int(np.argmin(values))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    optimize.minimize_scalar(neg_objective, bounds=(float(lo), float(hi)), method="bounded", options={"xatol": 0.1})
    k = max(feasible, key=lambda kk: (kk - 1.0) * feasible[kk][0])  # best of the grid and the refinement
    phi, clip = feasible[k]
    theta = phi / clip
    eps = epsilon_at(k, theta, clip)
    if eps > target_epsilon:
        raise ValueError(
            f"The accountant {accountant!r} is not invariant in C*theta: epsilon {eps:g} at the final point exceeds "
            f"the target {target_epsilon:g}"
        )
    return PlrvSearch(
        gamma_shape=k,
        gamma_scale=theta,
        max_grad_norm=clip,
        epsilon=eps,
        accountant=accountant,
        gamma_cdf=float(special.gammainc(k, 0.1 / theta)),
        max_order=max_order,
        shape_bounds=corollary_d2_shape_bounds(clip, theta, max_order),
    )
