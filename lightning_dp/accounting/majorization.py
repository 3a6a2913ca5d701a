"""Fast evaluation of the papers' per-coordinate majorization sums (LAP2 Thm III.7, PLRV-O Thm 4.9).

Both papers bound the MAF of an ``n``-coordinate mechanism by

    S(lambda) = sum_{i=1}^{n} phi_lambda(x_i),   x_i = C (sqrt(i) - sqrt(i-1)),
    phi_lambda(x) = log sum_{eta=0}^{lambda+1} w_eta(lambda, q) M(x, eta),

with ``M = F`` (Laplace, LAP2 eq. III.8) or ``M = G`` (Gamma-PLRV, PLRV-O eq. 20). The seeds loop over all ``n``
coordinates; for ``n = 1e9`` that is infeasible. We compute instead

    S_fast(lambda) = sum_{i <= H} phi(x_i) + int_{H+1/2}^{n+1/2} phi(x(t)) dt,  x(t) = C / (sqrt(t) + sqrt(t-1)),

which is an UPPER bound of ``S`` (so using it never under-reports the paper's epsilon), tight to ``O(1/H^2)``:

- ``x(t)`` is decreasing and convex on ``t >= 1``; ``M(., eta)`` is a positive mixture of exponentials (Laplace) or
  of Gamma MGFs (PLRV), hence log-convex and increasing in ``x``; a sum of log-convex functions is log-convex, so
  ``phi`` is convex and increasing. Therefore ``f = phi o x`` is convex in ``t``.
- Hermite-Hadamard: for convex ``f``, ``f(i) <= int_{i-1/2}^{i+1/2} f(t) dt``. Summing over ``i > H`` gives the bound.
- The integral is evaluated with composite Gauss-Legendre in ``z = log t`` (the integrand ``t f(t)`` is smooth and
  nearly constant there), accurate to ~3e-7 relative (measured against 30-node panels of width 0.5); the
  integral is inflated by ``QUADRATURE_SAFETY = 1 + 1e-6`` to cover it. Tested against the direct loop
  (tests/accounting/test_accounting_lap2.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from scipy.special import logsumexp

from lightning_dp.accounting.moments import log_binomial_weights

#: ``log_moment(x, eta) -> log M(x, eta)``: x shape ``(P, 1)``, eta shape ``(1, E)``, result ``(P, E)``.
LogMomentFn = Callable[[np.ndarray, np.ndarray], np.ndarray]

#: Number of coordinates summed exactly before switching to the integral bound.
HEAD = 16
#: Width (in ``log t``) of a Gauss-Legendre panel of the tail integral, and nodes per panel.
PANEL = 6.0
_GL_NODES, _GL_WEIGHTS = np.polynomial.legendre.leggauss(12)
#: Relative inflation of the tail integral covering its quadrature error (measured <= 3e-7 at n = 1e9).
QUADRATURE_SAFETY = 1.0 + 1e-6


def majorization_point(C: float, t: np.ndarray) -> np.ndarray:
    """``x(t) = C (sqrt(t) - sqrt(t-1)) = C / (sqrt(t) + sqrt(t-1))`` (LAP2 Lemma III.6), cancellation-free."""
    t = np.asarray(t, dtype=np.float64)
    return C / (np.sqrt(t) + np.sqrt(t - 1.0))


def _phi(points: np.ndarray, orders: np.ndarray, q: float, log_moment: LogMomentFn) -> np.ndarray:
    """``phi_lambda(x)`` for all orders and points; shape ``(L, P)``."""
    log_w = log_binomial_weights(orders, q)  # (L, E)
    eta = np.arange(log_w.shape[1], dtype=np.float64)
    log_m = log_moment(points[:, None], eta[None, :])  # (P, E)
    out = np.empty((orders.shape[0], points.shape[0]))
    for j in range(orders.shape[0]):
        width = int(orders[j]) + 2
        out[j] = logsumexp(log_w[j, None, :width] + log_m[:, :width], axis=1)
    return out


def paper_log_moments_direct(C: float, n: int, orders: np.ndarray, q: float, log_moment: LogMomentFn) -> np.ndarray:
    """Reference: the seeds' direct loop ``sum_{i=1}^{n} phi_lambda(x_i)``; cost ``O(n * sum(orders))``.

    Returns shape ``(L,)``. Use only for small ``n`` (tests).
    """
    points = majorization_point(C, np.arange(1, n + 1, dtype=np.float64))
    return _phi(points, orders, q, log_moment).sum(axis=1)


def paper_log_moments(C: float, n: int, orders: np.ndarray, q: float, log_moment: LogMomentFn) -> np.ndarray:
    """Upper bound ``S_fast(lambda) >= S(lambda)`` of the majorization sum (module docstring), any ``n >= 1``.

    Args:
        C: l2 clipping norm (> 0).
        n: number of coordinates (>= 1).
        orders: integer MAF orders, shape ``(L,)`` (validated, sorted).
        q: sample rate in ``[0, 1]``.
        log_moment: per-coordinate log moment ``log M(x, eta)`` (vectorised; see ``LogMomentFn``).

    Returns:
        Shape ``(L,)``, nats. Cost ``O((HEAD + 24 * panels) * sum(orders))``, independent of ``n``.
    """
    head = min(n, HEAD)
    points = [majorization_point(C, np.arange(1, head + 1, dtype=np.float64))]
    weights = [np.ones(head)]
    if n > head:
        z0, z1 = np.log(head + 0.5), np.log(n + 0.5)
        panels = max(1, int(np.ceil((z1 - z0) / PANEL)))
        edges = np.linspace(z0, z1, panels + 1)
        for a, b in zip(edges[:-1], edges[1:], strict=True):
            z = 0.5 * (b - a) * _GL_NODES + 0.5 * (a + b)
            t = np.exp(z)
            points.append(majorization_point(C, t))
            weights.append(QUADRATURE_SAFETY * 0.5 * (b - a) * _GL_WEIGHTS * t)
    x = np.concatenate(points)
    wts = np.concatenate(weights)
    return _phi(x, orders, q, log_moment) @ wts
