"""Shared machinery of the moments (MAF / Renyi) accountants of the Laplace family.

The MAF at integer order ``lambda >= 1`` is ``alpha(lambda) = log E_{o ~ mu}[(mu(o) / mu'(o))^lambda]`` (Mohammady
et al. 2026, LAP2, eq. II.8-II.10); MAFs add under composition. Subsampling weights: LAP2 Thm III.2, eq. III.4; the
remove direction: docs/accountants.md section 4.5, Lemma 1; conversion to epsilon: Balle et al. 2020, Thm 21. All in
log space, vectorised over orders.
"""

from __future__ import annotations

from abc import abstractmethod
from functools import lru_cache
from typing import Any

import numpy as np
from scipy.special import gammaln, logsumexp

from lightning_dp.accounting.base import Accountant

#: Default integer orders ``lambda`` (MAF orders; Renyi order is ``lambda + 1``): every integer up to 128, then a
#: geometric grid up to 6000. Shape ``(253,)``.
DEFAULT_ORDERS: np.ndarray = np.unique(
    np.concatenate([np.arange(1, 129), np.round(np.geomspace(129, 6000, 125))]).astype(np.int64)
)


def validate_sample_rate(q: float) -> None:
    """Raise ``ValueError`` unless ``0 <= q <= 1``."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"sample_rate q must lie in [0, 1] (expected_batch_size / N), got {q}")


def validate_positive(name: str, value: float, hint: str = "") -> None:
    """Raise ``ValueError`` unless ``value`` is a finite number ``> 0``."""
    if not (np.isfinite(value) and value > 0.0):
        raise ValueError(f"{name} must be a positive finite number, got {value}{'; ' + hint if hint else ''}")


def validate_orders(orders: np.ndarray) -> np.ndarray:
    """Return ``orders`` as a sorted int64 array; raise ``ValueError`` unless all are integers ``>= 1``."""
    arr = np.asarray(orders)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("orders must be a non-empty 1-D sequence of integers >= 1")
    as_int = np.round(arr).astype(np.int64)
    if np.any(as_int != arr) or np.any(as_int < 1):
        raise ValueError(f"orders must be integers >= 1 (MAF orders lambda), got {arr}")
    return np.unique(as_int)


@lru_cache(maxsize=32)
def _log_binomial_weights_cached(orders: tuple[int, ...], q: float) -> np.ndarray:
    lam = np.asarray(orders, dtype=np.float64)[:, None]
    eta = np.arange(int(max(orders)) + 2, dtype=np.float64)[None, :]
    m = lam + 1.0
    valid = eta <= m
    with np.errstate(divide="ignore", invalid="ignore"):
        log_comb = gammaln(m + 1.0) - gammaln(eta + 1.0) - gammaln(np.where(valid, m - eta, 0.0) + 1.0)
        log_1mq = np.log1p(-q) if q < 1.0 else -np.inf
        log_q = np.log(q) if q > 0.0 else -np.inf
        # 0 * log(0) = 0: the power (1-q)^0 and q^0 are 1 even when q is 0 or 1.
        term_1mq = np.where(m - eta == 0, 0.0, (m - eta) * log_1mq)
        term_q = np.where(eta == 0, 0.0, eta * log_q)
        out = np.where(valid, log_comb + term_1mq + term_q, -np.inf)
    out.setflags(write=False)
    return out


def log_binomial_weights(orders: np.ndarray, q: float) -> np.ndarray:
    """Log Poisson-subsampling weights for every order.

    Args:
        orders: integer MAF orders ``lambda >= 1``, shape ``(L,)``.
        q: sample rate in ``[0, 1]``.

    Returns:
        Array of shape ``(L, max(orders) + 2)``; entry ``[j, eta]`` is
        ``log[binom(lambda_j + 1, eta) (1-q)^(lambda_j+1-eta) q^eta]`` for ``eta <= lambda_j + 1``, else ``-inf``
        (LAP2 eq. III.4). Read-only (cached).

    Raises:
        ValueError: ``q`` outside ``[0, 1]`` or invalid orders.
    """
    validate_sample_rate(q)
    orders = validate_orders(orders)
    return _log_binomial_weights_cached(tuple(int(o) for o in orders), float(q))


def subsampled_log_moments(orders: np.ndarray, q: float, log_base_moments: np.ndarray) -> np.ndarray:
    """MAF of a Poisson-subsampled mechanism from its base moments (LAP2 eq. III.4; Mironov et al. 2019).

    Args:
        orders: integer MAF orders ``lambda``, shape ``(L,)`` (sorted, unique).
        q: sample rate in ``[0, 1]``.
        log_base_moments: shape ``(max(orders) + 2,)``; entry ``eta`` is an upper bound on ``log E_P[(Q/P)^eta]``
            over all neighbouring base pairs (``P`` without the example, ``Q`` with it). Entries 0 and 1 must be 0;
            ``+inf`` marks an order without finite bound.

    Returns:
        Shape ``(L,)``: ``log sum_eta w_eta M_eta``, an upper bound on the add-direction MAF; for symmetric base pairs
        (e.g. coordinate-wise even noise densities) also on the remove direction (docs/accountants.md, Lemma 1).
    """
    log_w = log_binomial_weights(orders, q)
    log_m = np.asarray(log_base_moments, dtype=np.float64)[: log_w.shape[1]]
    if log_m.shape[0] != log_w.shape[1]:
        raise ValueError(f"log_base_moments needs {log_w.shape[1]} entries (eta = 0..max order + 1)")
    with np.errstate(invalid="ignore"):
        terms = np.where(np.isneginf(log_w), -np.inf, log_w + log_m[None, :])
    return logsumexp(terms, axis=1)


def epsilon_from_log_moments(orders: np.ndarray, log_moments: np.ndarray, delta: float) -> float:
    """Convert a composed MAF to epsilon at ``delta`` (Balle et al. 2020, Thm 21; LAP2 seed after eq. II.10).

    Args:
        orders: integer MAF orders ``lambda >= 1``, shape ``(L,)``.
        log_moments: composed MAF ``alpha(lambda)`` (nats), shape ``(L,)``; ``+inf``/``nan`` entries are excluded.
        delta: target delta in ``(0, 1)``.

    Returns:
        ``max(0, min_lambda [alpha/lambda + log(lambda/(lambda+1)) - (log(delta) + log(lambda+1))/lambda])``;
        ``inf`` when no order is finite; 0 when every finite ``alpha`` is 0 (e.g. sample rate 0).

    Raises:
        ValueError: ``delta`` outside ``(0, 1)`` or shape mismatch.
    """
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must lie in (0, 1), got {delta}")
    lam = np.asarray(orders, dtype=np.float64)
    alpha = np.asarray(log_moments, dtype=np.float64)
    if lam.shape != alpha.shape:
        raise ValueError(f"orders {lam.shape} and log_moments {alpha.shape} must have the same shape")
    finite = np.isfinite(alpha)
    if not np.any(finite):
        return float("inf")
    lam, alpha = lam[finite], alpha[finite]
    if np.all(alpha <= 0.0):
        return 0.0  # zero divergence at every order: the ledger releases nothing about any individual
    eps = alpha / lam + np.log(lam / (lam + 1.0)) - (np.log(delta) + np.log(lam + 1.0)) / lam
    return float(max(0.0, np.min(eps)))


def expm1_minus_x(a: np.ndarray) -> np.ndarray:
    """``e^a - 1 - a >= 0`` without cancellation for small ``|a|`` (series below 1e-2). Elementwise."""
    a = np.asarray(a, dtype=np.float64)
    small = np.abs(a) < 1e-2
    series = a * a * (0.5 + a * (1.0 / 6 + a * (1.0 / 24 + a * (1.0 / 120 + a * (1.0 / 720)))))
    with np.errstate(over="ignore", invalid="ignore"):
        direct = np.expm1(a) - a
    return np.where(small, series, direct)


def log1p_minus_x(y: np.ndarray) -> np.ndarray:
    """``log(1 + y) - y <= 0`` for ``y > -1`` without cancellation for small ``|y|``. Elementwise."""
    y = np.asarray(y, dtype=np.float64)
    small = np.abs(y) < 1e-2
    series = -y * y * (0.5 - y * (1.0 / 3 - y * (0.25 - y * (0.2 - y * (1.0 / 6 - y / 7.0)))))
    with np.errstate(divide="ignore", invalid="ignore"):
        direct = np.log1p(y) - y
    return np.where(small, series, direct)


class MomentsAccountant(Accountant):
    """Shared ledger -> epsilon logic of the MAF accountants (``lap2``, ``plrv`` and their ``-paper`` modes).

    Subclasses implement :meth:`event_log_moments` (MAF of one step, shape ``(L,)`` over :attr:`orders`); this
    class composes the ledger (MAFs add, LAP2 eq. II.8) and converts with :func:`epsilon_from_log_moments`.

    Attributes:
        orders: integer MAF orders ``lambda`` used (default :data:`DEFAULT_ORDERS`); assign an array of integers
            ``>= 1`` on an instance to change them.
    """

    orders: np.ndarray = DEFAULT_ORDERS

    @abstractmethod
    def event_log_moments(self, event: Any) -> np.ndarray:
        """MAF (nats) of one application of ``event`` at each of :attr:`orders`, shape ``(L,)``; ``inf`` = none."""

    def log_moments(self) -> np.ndarray:
        """Composed MAF of the whole ledger, shape ``(L,)``."""
        total = np.zeros(validate_orders(self.orders).shape[0])
        for event, count in self.ledger:
            total = total + count * self.event_log_moments(event)
        return total

    def _epsilon(self, delta: float) -> float:
        return epsilon_from_log_moments(validate_orders(self.orders), self.log_moments(), delta)
