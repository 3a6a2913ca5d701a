"""Accountants for i.i.d. Laplace noise on an l2-clipped sum (``Lap2Event``): ``lap2`` (sound) and ``lap2-paper``.

Per coordinate with clipped value ``t`` and scale ``b``, the exact moment of the Laplace pair is (LAP2 eq. III.5)

    F(t, eta) = E_{o ~ Lap(0,b)}[(p_t(o)/p_0(o))^eta] = (eta e^{(eta-1)t/b} + (eta-1) e^{-eta t/b}) / (2 eta - 1).

``lap2`` (default, sound; docs/design.md section 6.4). For a clipped gradient ``g`` (``||g||_2 <= C``) the base moment
is ``prod_i F(|g_i|, eta) = exp(sum_i h_eta(g_i^2))`` with ``h_eta(s) = log F(sqrt(s), eta)``. ``h_eta`` is increasing
and CONCAVE in ``s`` for every real ``eta >= 1`` (proof in docs/accountants.md: with ``y = (2 eta - 1) t / b`` the
condition reduces to ``sinh(y) >= y``), so ``sum_i h_eta(s_i) <= n h_eta(C^2/n)`` for all feasible ``s`` with equality
at the uniform spread ``g = C/sqrt(n) * ones``: ``M_eta = F(C/sqrt(n), eta)^n`` is the exact worst-case base moment,
simultaneously for every ``eta``.

The reported MAF is the add direction ``log sum_eta w_eta M_eta``, the exact worst case of the subsampled
mechanism over the l2 ball. The remove direction is never larger: the base pair is symmetric under ``o -> g - o``,
and for every symmetric pair ``E_P[(1-q+qL)^(-lambda)] <= E_P[(1-q+qL)^(lambda+1)]`` (docs/accountants.md, Lemma 1,
generalising Mironov, Talwar & Zhang 2019 Thm 5 from the Gaussian). With ``q = 1`` (no subsampling) the MAF is
the exact base value ``n log F(C/sqrt(n), lambda+1)`` for both directions. Cost ``O(sum(orders))`` for any ``n``.

``lap2-paper``: LAP2 Thm III.7 (eq. III.7) evaluated by :mod:`lightning_dp.accounting.majorization`. NOT a valid bound
for the subsampled multivariate mechanism (the counterexample of docs/design.md section 6.3); kept to reproduce the
paper.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

import numpy as np

from lightning_dp.accounting.base import register_accountant
from lightning_dp.accounting.events import Lap2Event, PoissonSampledEvent
from lightning_dp.accounting.majorization import paper_log_moments
from lightning_dp.accounting.moments import (
    MomentsAccountant,
    expm1_minus_x,
    subsampled_log_moments,
    validate_orders,
    validate_positive,
    validate_sample_rate,
)

logger = logging.getLogger("lightning_dp")

PAPER_WARNING = (
    "accountant {name!r} reproduces the paper's per-coordinate majorization bound ({source}); it is NOT a valid "
    "upper bound for the Poisson-subsampled multivariate mechanism (subsampling acts on the whole vector) and can "
    "under-report epsilon, e.g. b=0.5, q=0.01, lambda=32, n=2: paper MAF 0.3653 vs exact 1.221 (docs/design.md "
    "section 6.3). Use {sound!r} for a guarantee."
)


def laplace_log_moment(beta: np.ndarray, eta: np.ndarray) -> np.ndarray:
    """``log F`` of LAP2 eq. III.5 with ``beta = t / b`` (broadcast with ``eta``), without cancellation.

    Uses ``F - 1 = [eta E((eta-1) beta) + (eta-1) E(-eta beta)] / (2 eta - 1)`` with ``E(a) = e^a - 1 - a >= 0`` (the
    linear terms cancel exactly), so tiny ``beta`` (``n`` up to 1e12) keeps full relative precision; large arguments
    use the log-sum-exp form. ``eta = 0`` and ``eta = 1`` give 0. Units: nats.
    """
    beta = np.asarray(beta, dtype=np.float64)
    eta = np.asarray(eta, dtype=np.float64)
    m = 2.0 * eta - 1.0
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        small = (eta - 1.0) * beta < 30.0
        fm1 = (eta * expm1_minus_x((eta - 1.0) * beta) + (eta - 1.0) * expm1_minus_x(-eta * beta)) / m
        via_small = np.log1p(np.where(small, fm1, 0.0))
        via_large = (eta - 1.0) * beta + np.log(eta / m) + np.log1p((eta - 1.0) / eta * np.exp(-m * beta))
        out = np.where(small, via_small, via_large)
    return np.where(eta <= 1.0, 0.0, out)


def _lap2_parts(event: Any) -> tuple[float, Lap2Event]:
    if isinstance(event, PoissonSampledEvent):
        return float(event.sample_rate), event.event
    return 1.0, event


def _validate_lap2(event: Lap2Event) -> None:
    validate_positive("Lap2Event.noise_scale (Laplace scale b)", event.noise_scale)
    validate_positive("Lap2Event.max_grad_norm (l2 clip C)", event.max_grad_norm)
    if int(event.num_params) < 1:
        raise ValueError(f"Lap2Event.num_params must be a positive integer, got {event.num_params}")


def _supports_lap2(event: Any) -> bool:
    if isinstance(event, PoissonSampledEvent):
        return 0.0 <= event.sample_rate <= 1.0 and isinstance(event.event, Lap2Event)
    return isinstance(event, Lap2Event)


@lru_cache(maxsize=256)
def lap2_sound_log_moments(event: Any, orders: tuple[int, ...]) -> np.ndarray:
    """Sound MAF of one ``Lap2Event`` / ``PoissonSampledEvent(q, Lap2Event)`` step (module docstring).

    Returns:
        Shape ``(len(orders),)``, nats: the exact worst-case MAF (both directions) for ``0 < q < 1``; the exact base MAF
        ``n log F(C/sqrt(n), lambda+1)`` for ``q = 1``; zeros for ``q = 0``.

    Raises:
        ValueError: non-positive scale/clip/num_params or ``q`` outside ``[0, 1]``.
    """
    q, base = _lap2_parts(event)
    validate_sample_rate(q)
    _validate_lap2(base)
    ords = validate_orders(np.asarray(orders))
    n = int(base.num_params)
    beta = base.max_grad_norm / (base.noise_scale * np.sqrt(n))
    eta = np.arange(int(ords[-1]) + 2, dtype=np.float64)
    log_base = n * laplace_log_moment(beta, eta)
    if q == 0.0:
        return np.zeros(ords.shape[0])
    if q == 1.0:
        return log_base[ords + 1]
    return subsampled_log_moments(ords, q, log_base)


@lru_cache(maxsize=64)
def lap2_paper_log_moments(event: Any, orders: tuple[int, ...]) -> np.ndarray:
    """LAP2 Thm III.7 (eq. III.7-III.8) MAF of one step, via the fast majorization-sum upper bound.

    Returns shape ``(len(orders),)``, nats (never below the seed's direct loop; see ``majorization``).
    """
    q, base = _lap2_parts(event)
    validate_sample_rate(q)
    _validate_lap2(base)
    ords = validate_orders(np.asarray(orders))
    b = float(base.noise_scale)

    def log_moment(x: np.ndarray, eta: np.ndarray) -> np.ndarray:
        return laplace_log_moment(x / b, eta)

    return paper_log_moments(float(base.max_grad_norm), int(base.num_params), ords, q, log_moment)


@register_accountant
class Lap2Accountant(MomentsAccountant):
    """Sound accountant for ``Lap2Event`` and ``PoissonSampledEvent(q, Lap2Event)`` (default for ``lap2`` and
    ``laplace-advanced`` mechanisms). Add/remove neighbours, Poisson sampling. See the module docstring."""

    name = "lap2"

    def supports(self, event: Any) -> bool:
        return _supports_lap2(event)

    def event_log_moments(self, event: Any) -> np.ndarray:
        return lap2_sound_log_moments(event, tuple(int(o) for o in validate_orders(self.orders)))


@register_accountant
class Lap2PaperAccountant(MomentsAccountant):
    """LAP2 paper accountant (Thm III.7): reproduces the paper; logs a warning that it is not a valid bound."""

    name = "lap2-paper"
    note = "paper bound (eq. III.7), not valid for the subsampled mechanism"
    plot_label = "lap2-paper (not a valid bound)"

    def __init__(self) -> None:
        super().__init__()
        logger.warning(PAPER_WARNING.format(name=self.name, source="LAP2 Thm III.7", sound="lap2"))

    def supports(self, event: Any) -> bool:
        return _supports_lap2(event)

    def event_log_moments(self, event: Any) -> np.ndarray:
        return lap2_paper_log_moments(event, tuple(int(o) for o in validate_orders(self.orders)))
