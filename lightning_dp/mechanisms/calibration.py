"""Noise calibration for a target (epsilon, delta); the LAP2 / PLRV-O parameter searches are re-exported here.

- :func:`calibrate`: fixed clipping bound ``C``; find the noise parameter whose accountant epsilon after ``steps``
  Poisson-subsampled steps lies in ``[(1 - rtol) target, target]`` (``rtol = 1 %``). One monotone root finder,
  :func:`solve_monotone` (scipy ``brentq`` in log-parameter space, keeping the best point on the safe side), serves
  every mechanism (module :mod:`lightning_dp.mechanisms.solver`).
- :func:`search_lap2`: LAP2 seed, Alg. 1 -- the largest ``C`` with its smallest feasible Laplace scale ``b``
  (module :mod:`lightning_dp.mechanisms.search_lap2`).
- :func:`search_plrv`: PLRV-O seed, Alg. 1 -- maximise ``C (k - 1) theta`` subject to constraints c0-c4
  (module :mod:`lightning_dp.mechanisms.search_plrv`).

The accountants are looked up by name (``make_accountant``); the mechanism's ``default_accountant`` is used when
none is given, except for ``laplace-advanced`` whose calibration is, by definition, the literature review's
advanced-composition formula (accountant ``"advanced"``).
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_dp.accounting.composition import advanced_laplace_noise_scale, basic_laplace_noise_scale
from lightning_dp.mechanisms.base import (
    MECHANISMS,
    NoiseMechanism,
    make_mechanism,
    mechanism_class,
    validate_max_grad_norm,
)
from lightning_dp.mechanisms.gaussian import GaussianMechanism
from lightning_dp.mechanisms.search_lap2 import Lap2Search, search_lap2
from lightning_dp.mechanisms.search_plrv import (
    PlrvSearch,
    corollary_d2_shape_bounds,
    gamma_scale_lower_bound,
    search_plrv,
)
from lightning_dp.mechanisms.solver import (
    RTOL,
    CalibrationResult,
    _require_num_params,
    _validate_target,
    closed_form_noise_ratio,
    mechanism_epsilon,
    solve_monotone,
)

__all__ = [
    "PLD_MIN_NOISE_MULTIPLIER",
    "RTOL",
    "CalibrationResult",
    "Lap2Search",
    "PlrvSearch",
    "calibrate",
    "calibrate_result",
    "closed_form_noise_ratio",
    "corollary_d2_shape_bounds",
    "gamma_scale_lower_bound",
    "mechanism_epsilon",
    "resolve_accountant",
    "search_lap2",
    "search_plrv",
    "solve_monotone",
]

#: Smallest Gaussian noise multiplier calibrated with the PLD accountant. The PLD grid of dp-accounting grows as sigma
#: falls (measured at q = 0.01, T = 1000 on one core: sigma 0.5 -> 3.6 s, 0.3 -> 7 s, 0.1 -> 99 s and 2.3 GB), while
#: such noise already means epsilon in the tens or more; below it :func:`calibrate_result` stops with a clear error
#: (the cheap RDP warm start tells within seconds).
PLD_MIN_NOISE_MULTIPLIER = 0.3


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
