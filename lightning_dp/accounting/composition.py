"""Composition-theorem accountants: ``basic`` (pure DP, sequential composition) and ``advanced``.

``basic`` (Dwork & Roth 2014, Thm 3.16): a ``LaplaceEvent`` step is ``C/b``-DP, a ``Lap2Event`` step over ``n``
coordinates ``sqrt(n) C / b``-DP; Poisson sampling amplifies ``eps`` to ``log(1 + q (e^eps - 1))`` (Balle, Barthe &
Gaboardi 2018, Thm 8); epsilons add, delta is 0.

``advanced`` (Dwork, Rothblum & Vadhan 2010; Dwork & Roth 2014, Thm 3.20; Kairouz, Oh & Viswanath 2015, Thm 3.5):
``k`` steps, each ``(eps_i, delta_0)``-DP, compose to ``(sqrt(2 ln(1/delta') sum eps_i^2) + sum eps_i (e^{eps_i} -
1), k delta_0 + delta')`` with ``delta' = delta/2``, ``delta_0 = delta/(2k)``; the reported epsilon is the smaller of
that and ``sum eps_i``. A ``Lap2Event`` step's epsilon at ``delta_0`` is the Hoeffding bound

    eps_0 = min(C^2/(2 b^2) + (C/b) sqrt(2 ln(1/delta_0)), sqrt(n) C/b)

(proof, and why not the Gaussian formula the literature review applies: docs/accountants.md section 4.1).
"""

from __future__ import annotations

import math
from typing import Any

from scipy.optimize import brentq

from lightning_dp.accounting.base import Accountant, register_accountant, validate_delta, validate_epsilon
from lightning_dp.accounting.events import Lap2Event, LaplaceEvent, PoissonSampledEvent
from lightning_dp.accounting.moments import validate_positive, validate_sample_rate


def _validate_steps(steps: int) -> int:
    if int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps}")
    return int(steps)


def amplify_pure(epsilon: float, q: float) -> float:
    """``log(1 + q (e^eps - 1))``: Poisson-subsampling amplification (Balle et al. 2018 Thm 8), nats."""
    validate_sample_rate(q)
    return math.log1p(q * math.expm1(epsilon)) if math.isfinite(epsilon) else (math.inf if q > 0 else 0.0)


def lap2_pure_epsilon(noise_scale: float, max_grad_norm: float, num_params: int) -> float:
    """Pure-DP epsilon ``sqrt(n) C / b`` of one ``Lap2Event`` step (l1 sensitivity ``<= sqrt(n)`` times l2)."""
    validate_positive("noise_scale", noise_scale)
    validate_positive("max_grad_norm", max_grad_norm)
    return math.sqrt(num_params) * max_grad_norm / noise_scale


def lap2_step_epsilon(noise_scale: float, max_grad_norm: float, num_params: int, delta0: float) -> float:
    """Sound per-step epsilon of ``Lap2Event`` at ``delta0`` (module docstring; Hoeffding + pure bound).

    Returns ``min(C^2/(2b^2) + (C/b) sqrt(2 ln(1/delta0)), sqrt(n) C/b)``; 0 when ``delta0 >= 1``.

    Raises:
        ValueError: non-positive scale / clip or ``delta0 <= 0``.
    """
    pure = lap2_pure_epsilon(noise_scale, max_grad_norm, num_params)
    if not delta0 > 0.0:
        raise ValueError(f"per-step delta must be positive, got {delta0}")
    if delta0 >= 1.0:
        return 0.0
    ratio = max_grad_norm / noise_scale
    return min(pure, 0.5 * ratio * ratio + ratio * math.sqrt(2.0 * math.log(1.0 / delta0)))


def advanced_composition_epsilon(eps0: float, steps: int, delta_prime: float) -> float:
    """``eps0 sqrt(2 k ln(1/delta')) + k eps0 (e^eps0 - 1)`` (literature review eq. 4.3; DRV 2010)."""
    return eps0 * math.sqrt(2.0 * steps * math.log(1.0 / delta_prime)) + steps * eps0 * math.expm1(eps0)


def basic_laplace_noise_scale(
    target_epsilon: float, steps: int, max_grad_norm: float, sample_rate: float = 1.0
) -> tuple[float, float]:
    """Laplace scale for ``steps`` pure-DP steps under basic composition.

    Args:
        target_epsilon: total epsilon (> 0).
        steps: number of steps ``k`` (>= 1).
        max_grad_norm: l1 clipping norm ``C`` (> 0); the l1 sensitivity of the clipped sum.
        sample_rate: Poisson rate ``q`` in ``(0, 1]``; the per-step budget is un-amplified
            (``eps_base = log(1 + (e^{eps/k} - 1)/q)``).

    Returns:
        ``(eps_step, scale)``: the (amplified) per-step epsilon ``eps/k`` and ``b = C / eps_base``
        (``eps=3, k=1220, C=3`` gives ``scale = 1220``).

    Raises:
        ValueError: non-positive epsilon/clip, ``steps < 1`` or ``q`` outside ``(0, 1]``.
    """
    validate_epsilon(target_epsilon)
    steps = _validate_steps(steps)
    validate_positive("max_grad_norm", max_grad_norm)
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate}")
    eps_step = target_epsilon / steps
    eps_base = math.log1p(math.expm1(eps_step) / sample_rate)
    return eps_step, max_grad_norm / eps_base


def advanced_laplace_noise_scale(
    target_epsilon: float, delta: float, steps: int, max_grad_norm: float, sample_rate: float = 1.0
) -> tuple[float, float, float]:
    """Laplace scale for the ``laplace-advanced`` mechanism.

    Solves ``eps0 sqrt(2k ln(1/delta')) + k eps0 (e^eps0 - 1) = target_epsilon``; the scale is the larger of the
    literature review's ``(C/eps0) sqrt(2 ln(1.25/delta0))`` and the one at which :func:`lap2_step_epsilon` equals
    ``eps0``. With ``q < 1`` the base mechanism gets ``(log(1 + (e^eps0 - 1)/q), delta0/q)``.

    Args:
        target_epsilon: total epsilon (> 0).
        delta: total delta in ``(0, 1)``.
        steps: number of steps ``k`` (>= 1).
        max_grad_norm: l2 clipping norm ``C`` (> 0).
        sample_rate: Poisson rate in ``(0, 1]``.

    Returns:
        ``(eps0, delta0, scale)`` (``eps=3, delta=1e-5, k=1220, C=3`` gives ``eps0 = 0.01564``, ``delta0 =
        4.098e-9``, ``scale = 1198.9``).

    Raises:
        ValueError: invalid epsilon, delta, steps, clip or sample rate.
    """
    validate_epsilon(target_epsilon)
    validate_delta(delta)
    steps = _validate_steps(steps)
    validate_positive("max_grad_norm", max_grad_norm)
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate}")
    delta_prime = delta / 2.0
    delta0 = delta / (2.0 * steps)

    def excess(eps0: float) -> float:
        return advanced_composition_epsilon(eps0, steps, delta_prime) - target_epsilon

    hi = 1.0
    while excess(hi) < 0.0:
        hi *= 2.0
    eps0 = brentq(excess, 0.0, hi, xtol=1e-15, rtol=1e-14)
    eps_base = math.log1p(math.expm1(eps0) / sample_rate)
    delta_base = delta0 / sample_rate
    if delta_base >= 1.0:
        raise ValueError(
            f"per-step delta {delta0:.3g} / sample_rate {sample_rate} >= 1: increase steps or decrease delta"
        )
    review = max_grad_norm / eps_base * math.sqrt(2.0 * math.log(1.25 / delta_base))
    a = math.sqrt(2.0 * math.log(1.0 / delta_base))
    ratio = -a + math.sqrt(a * a + 2.0 * eps_base)  # C/b solving (C/b)^2/2 + a C/b = eps_base
    sound = max_grad_norm / ratio
    return eps0, delta0, max(review, sound)


def _split(event: Any) -> tuple[float, Any]:
    if isinstance(event, PoissonSampledEvent):
        return float(event.sample_rate), event.event
    return 1.0, event


def _check_event(base: Any) -> None:
    validate_positive(f"{type(base).__name__}.noise_scale", base.noise_scale)
    validate_positive(f"{type(base).__name__}.max_grad_norm", base.max_grad_norm)
    if isinstance(base, Lap2Event) and int(base.num_params) < 1:
        raise ValueError(f"Lap2Event.num_params must be a positive integer, got {base.num_params}")


def _supports(event: Any) -> bool:
    q, base = _split(event)
    return 0.0 <= q <= 1.0 and isinstance(base, LaplaceEvent | Lap2Event)


@register_accountant
class BasicCompositionAccountant(Accountant):
    """Sequential composition of pure-DP Laplace steps (``basic``); delta is reported as 0.

    Supports ``LaplaceEvent``, ``Lap2Event`` and ``PoissonSampledEvent`` of either (module docstring).
    """

    name = "basic"
    pure = True

    def supports(self, event: Any) -> bool:
        return _supports(event)

    @staticmethod
    def step_epsilon(event: Any) -> float:
        """Pure epsilon of one application of ``event`` (after amplification). Raises ``ValueError`` if invalid."""
        q, base = _split(event)
        validate_sample_rate(q)
        _check_event(base)
        if isinstance(base, LaplaceEvent):
            eps = base.max_grad_norm / base.noise_scale
        else:
            eps = lap2_pure_epsilon(base.noise_scale, base.max_grad_norm, int(base.num_params))
        return amplify_pure(eps, q)

    def _epsilon(self, delta: float) -> float:
        return sum(count * self.step_epsilon(event) for event, count in self.ledger)


@register_accountant
class AdvancedCompositionAccountant(Accountant):
    """Advanced composition (``advanced``) of ``Lap2Event`` / ``LaplaceEvent`` steps, optionally Poisson-sampled.

    A Poisson-sampled step's base mechanism gets ``delta/(2kq)`` and its epsilon is amplified (module docstring).
    """

    name = "advanced"
    note = "advanced composition (literature review 4.3)"
    plot_label = "advanced composition"

    def supports(self, event: Any) -> bool:
        return _supports(event)

    def _epsilon(self, delta: float) -> float:
        steps = self.steps
        delta_prime = delta / 2.0
        delta_step = delta / (2.0 * steps)
        total = total_sq = total_drift = 0.0
        for event, count in self.ledger:
            q, base = _split(event)
            validate_sample_rate(q)
            _check_event(base)
            if q == 0.0:
                continue
            if isinstance(base, LaplaceEvent):
                eps_base = base.max_grad_norm / base.noise_scale
            else:
                eps_base = lap2_step_epsilon(base.noise_scale, base.max_grad_norm, int(base.num_params), delta_step / q)
            eps = amplify_pure(eps_base, q)
            total += count * eps
            total_sq += count * eps * eps
            total_drift += count * eps * math.expm1(eps)
        advanced = math.sqrt(2.0 * math.log(1.0 / delta_prime) * total_sq) + total_drift
        return min(total, advanced)
