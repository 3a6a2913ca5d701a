"""The ``rc`` accountant: DP-SGD with randomized clipping (Ullah et al. 2026, DP-SGD-RC, Sec. 5.2, Algorithm 5).

One step is the Gaussian mechanism with sensitivity ``C a``, a random scale ``a = 1 / sqrt(Y)`` revealed to the
adversary (Thm 5.1, Lemma B.2 / B.3; ``Y`` from :mod:`lightning_dp.accounting.rc_envelope`). The hockey-stick
divergence is linear in the mixture:

    delta_step(eps) = sum_m w_m delta_gauss(eps; mu = a_m / sigma, q)  +  w_inf delta_gauss(eps; mu = inf, q),

with ``(a_m, w_m, w_inf)`` from :func:`~lightning_dp.accounting.rc_envelope.scale_atoms` (Algorithm 5 lines 4-11,
each cell at its pessimistic end). Both directions of add/remove-one are bounded, the larger epsilon reported.
``dp_accounting``'s pessimistic connect-the-dots PMF (Doroshenko et al. 2022, Alg. 1; loss grid ``h = 1e-4``) and
``PrivacyLossDistribution`` compose the steps. ``norm_dim`` is recorded but does not change the epsilon. Soundness:
docs/accountants.md section 4.6.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution
from scipy import optimize, special

from lightning_dp.accounting.base import Accountant, register_accountant
from lightning_dp.accounting.events import GaussianEvent, PoissonSampledEvent, RandomizedClippingGaussianEvent
from lightning_dp.accounting.rc_envelope import scale_atoms, validate_rc

#: Loss-grid spacing (same as the ``pld`` accountant) and the largest number of grid points per step.
VALUE_DISCRETIZATION_INTERVAL = 1e-4
MAX_GRID_POINTS = 400_000
#: Largest noise quantile (in standard deviations) bounding a component's exactly evaluated loss range (tail mass
#: ~1e-12); beyond it :func:`mixture_delta` uses pessimistic bounds.
_TAIL_SD = 7.0
#: Share of the target delta that the pessimistic infinity atoms of all steps may take together (they only cost
#: tightness, never soundness): per step, ``NEGLIGIBLE_SHARE * delta / steps`` for the far tail of ``a`` and as
#: much for the loss tail beyond the grid.
NEGLIGIBLE_SHARE = 1e-4


def randomized_clipping_step_event(
    noise_multiplier: float,
    sample_rate: float,
    projection_dim: int,
    norm_dim: int,
    estimator: str = "hutch",
) -> PoissonSampledEvent:
    """The privacy event of one DP-SGD-RC step (seed Alg. 1 with Alg. 2 as the norm estimator).

    Args:
        noise_multiplier: sigma (noise std ``sigma * C`` on the clipped sum), ``>= 0``.
        sample_rate: Poisson rate ``q`` in ``[0, 1]``.
        projection_dim: k, Gaussian projection columns of the estimator.
        norm_dim: d, the largest unprojected dimension ``max_l min(p_l, d_l)`` over estimated layers (the
            conservative choice; the ``rc`` accountant's bound holds for every d).
        estimator: ``"hutch"`` or ``"hutchpp"``.

    Raises:
        ValueError: invalid k, d, estimator or negative sigma.
    """
    validate_rc(projection_dim, norm_dim, estimator)
    if not noise_multiplier >= 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
    inner = RandomizedClippingGaussianEvent(float(noise_multiplier), int(projection_dim), int(norm_dim), estimator)
    return PoissonSampledEvent(float(sample_rate), inner)


def _curve_terms(eps: np.ndarray, q: float, remove: bool) -> tuple[np.ndarray, ...]:
    """The mu-independent parts of :func:`subsampled_gaussian_delta` on ``eps`` ``[n]`` (shared by all components).

    Returns ``(base, log_ratio, coef_a, coef_b)`` such that ``delta = base + coef_a Phi(s_a) + coef_b Phi(s_b)``
    with ``x = log_ratio / mu + mu / 2`` and ``(s_a, s_b) = (mu - x, -x)`` (remove) or ``(x, x - mu)`` (add).
    """
    eps = np.asarray(eps, dtype=float)
    if remove:
        active = eps > math.log1p(-q) if q < 1 else np.ones_like(eps, dtype=bool)
        gap = np.where(active, np.expm1(np.where(active, eps, 0.0)) + q, q)  # e^eps - (1 - q)
        base = np.where(active, 0.0, -np.expm1(eps))
        return base, np.log(gap / q), np.where(active, q, 0.0), np.where(active, -gap, 0.0)
    active = eps < -math.log1p(-q) if q < 1 else np.ones_like(eps, dtype=bool)
    e = np.where(active, eps, 0.0)
    ratio = np.where(active, (np.expm1(-e) + q) / q, 1.0)  # (e^-eps - (1 - q)) / q
    coef_a = np.where(active, -np.expm1(e) + q * np.exp(e), 0.0)  # 1 - e^eps (1 - q)
    return np.zeros_like(eps), np.log(ratio), coef_a, np.where(active, -q * np.exp(e), 0.0)


def _delta_from_terms(terms: tuple[np.ndarray, ...], mu: float, remove: bool) -> np.ndarray:
    base, log_ratio, coef_a, coef_b = terms
    if math.isinf(mu):  # the sample's output is disjoint from the rest
        return np.clip(base + coef_a, 0.0, 1.0)
    x = log_ratio / mu + 0.5 * mu
    if remove:
        out = base + coef_a * special.ndtr(mu - x) + coef_b * special.ndtr(-x)
    else:
        out = base + coef_a * special.ndtr(x) + coef_b * special.ndtr(x - mu)
    return np.clip(out, 0.0, 1.0)


def subsampled_gaussian_delta(epsilons: np.ndarray, mu: float, q: float, remove: bool) -> np.ndarray:
    """Hockey-stick curve ``delta(eps)`` of the Poisson-subsampled Gaussian with shift ``mu`` (noise std 1).

    REMOVE: ``delta = q Phibar(x - mu) - (e^eps - 1 + q) Phibar(x)`` with ``x = (log((e^eps - 1 + q)/q) + mu^2/2)
    / mu`` for ``eps > log(1 - q)``, else ``1 - e^eps``. ADD: ``delta = (1 - e^eps (1 - q)) Phi(x) - q e^eps
    Phi(x - mu)`` with ``x = (log((e^-eps - 1 + q)/q) + mu^2/2) / mu`` for ``eps < -log(1 - q)``, else 0.
    ``mu = inf`` gives the limits ``q + (1 - q - e^eps)_+`` (remove) and ``(1 - e^eps (1 - q))_+`` (add).

    Args:
        epsilons: shape ``[n]``. mu: ``a / sigma > 0`` or ``inf``. q: sample rate in ``(0, 1]``.

    Returns:
        deltas, shape ``[n]``, clipped to ``[0, 1]``.
    """
    return _delta_from_terms(_curve_terms(epsilons, q, remove), mu, remove)


def _loss_range(mu: float, q: float, remove: bool, tail_sd: float = 7.0) -> tuple[float, float]:
    """Loss interval of one component holding its noise within ``tail_sd`` standard deviations."""
    top = 0.5 * mu * mu + tail_sd * mu  # unsubsampled loss at x = mu + t
    hi = float(np.logaddexp(math.log1p(-q), math.log(q) + top)) if q < 1 else top  # log(1 - q + q e^top)
    if remove:
        return (math.log1p(-q) if q < 1 else -top), hi
    return -hi, (-math.log1p(-q) if q < 1 else top)


def mixture_delta(
    grid: np.ndarray,
    mus: np.ndarray,
    weights: np.ndarray,
    inf_mass: float,
    q: float,
    remove: bool,
    negligible_delta: float = 1e-18,
) -> np.ndarray:
    """Upper bound on ``sum_m w_m delta(eps; mu_m) + inf_mass delta(eps; inf)`` on the sorted ``grid`` ``[n]``.

    Each component is evaluated exactly on its own :func:`_loss_range` only and bounded outside it (monotone above,
    ``1 - e^eps + r_m`` below), at cost ``O(sum_m |range_m|)`` instead of ``O(M n)``; derivation:
    docs/accountants.md section 4.6.
    """
    h_lo, h_hi = float(grid[0]), float(grid[-1])
    n = grid.size
    terms = _curve_terms(grid, q, remove)
    out = inf_mass * _delta_from_terms(terms, math.inf, remove)
    above = np.zeros(n + 1)  # constants added for grid index > j (cumulative)
    below_w = np.zeros(n + 1)  # weights whose bound 1 - e^eps + r applies at grid index < j
    below_r = np.zeros(n + 1)
    step = (h_hi - h_lo) / max(n - 1, 1)
    tail_sds = np.clip(-special.ndtri(np.minimum(0.5, negligible_delta / (len(mus) * weights * q))), 2.0, _TAIL_SD)
    for mu, w, tail_sd in zip(mus, weights, tail_sds, strict=True):
        lo, hi = _loss_range(float(mu), q, remove, float(tail_sd))
        i = min(max(math.floor((lo - h_lo) / step), 0), n - 1)  # grid cell around [lo, hi], ends included
        j = min(max(math.ceil((hi - h_lo) / step), i), n - 1)
        part = _delta_from_terms(tuple(t[i : j + 1] for t in terms), float(mu), remove)
        out[i : j + 1] += w * part
        above[j + 1] += w * part[-1]
        r = max(part[0] + math.expm1(float(grid[i])), 0.0)
        below_w[i] += w
        below_r[i] += w * r
    out += np.cumsum(above)[:n]
    pending_w = np.cumsum(below_w[::-1])[::-1][1:]  # sum of weights with i_m > index
    pending_r = np.cumsum(below_r[::-1])[::-1][1:]
    out += pending_w * (-np.expm1(grid)) + pending_r
    return np.clip(out, 0.0, 1.0)


@functools.lru_cache(maxsize=64)
def step_pld(
    noise_multiplier: float,
    sample_rate: float,
    projection_dim: int | None,
    negligible_delta: float = 1e-18,
    value_discretization_interval: float = VALUE_DISCRETIZATION_INTERVAL,
) -> PrivacyLossDistribution:
    """Pessimistic PLD (both directions) of one Poisson-subsampled randomized-clipping Gaussian step (cached).

    ``negligible_delta``: the per-step delta the far tails may add to the infinity atom (scales beyond the
    ``min(1e-8, negligible_delta / q)`` quantile count as ``a = inf``). ``projection_dim=None``: deterministic clipping
    (``a = 1``), the plain subsampled Gaussian.
    """
    if projection_dim is None:
        scales, weights, inf_mass = np.ones(1), np.ones(1), 0.0
    else:
        tail_mass = min(1e-8, negligible_delta / sample_rate)
        scales, weights, inf_mass = scale_atoms(projection_dim, tail_mass=tail_mass)
    return mixture_step_pld(
        noise_multiplier, sample_rate, scales, weights, inf_mass, negligible_delta, value_discretization_interval
    )


def mixture_step_pld(
    noise_multiplier: float,
    sample_rate: float,
    scales: np.ndarray,
    weights: np.ndarray,
    infinite_mass: float = 0.0,
    negligible_delta: float = 1e-18,
    value_discretization_interval: float = VALUE_DISCRETIZATION_INTERVAL,
) -> PrivacyLossDistribution:
    """Pessimistic PLD of one subsampled Gaussian step whose sensitivity scale ``a`` is revealed and random.

    Args:
        noise_multiplier: sigma > 0. sample_rate: q in ``(0, 1]``.
        scales: finite scales ``a_m > 0``, shape ``[M]`` (sensitivity ``a_m C``). weights: their probabilities
            ``[M]``. infinite_mass: probability of ``a = inf`` (weights + infinite_mass = 1).
        negligible_delta: the remove-direction grid ends where the finite components' ``delta`` drops below it (the
            rest becomes the infinity atom; the add-direction grid is its mirror image).
        value_discretization_interval: loss-grid spacing ``h``; at most ``MAX_GRID_POINTS`` points.
    """
    sigma, q, h, inf_mass = noise_multiplier, sample_rate, value_discretization_interval, infinite_mass
    weights = np.asarray(weights, dtype=float)
    keep = weights > 0
    mus, weights = np.asarray(scales, dtype=float)[keep] / sigma, weights[keep]
    lo, hi = _loss_range(float(mus.max()), q, remove=True)

    def tail(eps: float) -> float:  # finite components' remove delta minus the threshold
        at = np.array([eps])
        finite = sum(w * subsampled_gaussian_delta(at, m, q, True)[0] for m, w in zip(mus, weights, strict=True))
        return float(finite) - negligible_delta

    hi = min(hi, 700.0)  # e^eps must stay finite; beyond, the grid cap below applies anyway
    if tail(hi) < 0 < tail(max(lo, 0.0)):  # shorten the grid to where the mixture's delta is negligible
        hi = optimize.brentq(tail, max(lo, 0.0), hi, xtol=1e-3)
    pmfs = []
    for remove in (True, False):
        i_lo, i_hi = (math.floor(lo / h), math.ceil(hi / h)) if remove else (-math.ceil(hi / h), math.ceil(-lo / h))
        if i_hi - i_lo > MAX_GRID_POINTS:  # cut the far side pessimistically (infinity atom / moved up)
            i_hi, i_lo = (i_lo + MAX_GRID_POINTS, i_lo) if remove else (i_hi, i_hi - MAX_GRID_POINTS)
        grid = np.arange(i_lo, i_hi + 1) * h
        deltas = mixture_delta(grid, mus, weights, inf_mass, q, remove, negligible_delta)
        deltas = np.minimum.accumulate(deltas)  # remove rounding noise (the curve is non-increasing)
        pmfs.append(pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(h, i_lo, i_hi, deltas))
    return PrivacyLossDistribution(pmfs[0], pmfs[1])


def _step_key(event: Any) -> tuple[float, float, int | None] | None:
    """``(sigma, q, k)`` of a supported event (``k = None``: exact clipping); None if unsupported."""
    q = 1.0
    if isinstance(event, PoissonSampledEvent):
        q, event = event.sample_rate, event.event
        if not 0.0 <= q <= 1.0:
            return None
    if isinstance(event, GaussianEvent):
        return event.noise_multiplier, q, None
    if isinstance(event, RandomizedClippingGaussianEvent):
        validate_rc(event.projection_dim, event.norm_dim, event.estimator)
        return event.noise_multiplier, q, event.projection_dim
    return None


@register_accountant
class RandomizedClippingAccountant(Accountant):
    """PRV/PLD accountant of DP-SGD with randomized clipping (Hutch / Hutch++ norms), add/remove-one, both directions.

    Accepts ``RandomizedClippingGaussianEvent`` and ``GaussianEvent`` (``a = 1``), alone or inside
    ``PoissonSampledEvent``. Returns ``inf`` for a zero noise multiplier, or when the pessimistic infinity atom alone
    exceeds delta.
    """

    name = "rc"

    def supports(self, event: Any) -> bool:
        return _step_key(event) is not None

    def _epsilon(self, delta: float) -> float:
        total: PrivacyLossDistribution | None = None
        negligible = NEGLIGIBLE_SHARE * delta / max(self.steps, 1)
        for event, count in self.ledger:
            key = _step_key(event)
            assert key is not None, "compose admits only supported events"
            sigma, q, k = key
            if q == 0.0:
                continue
            if sigma == 0:
                return math.inf
            composed = step_pld(float(sigma), float(q), k, negligible).self_compose(int(count))
            total = composed if total is None else total.compose(composed)
        return 0.0 if total is None else float(total.get_epsilon_for_delta(delta))
