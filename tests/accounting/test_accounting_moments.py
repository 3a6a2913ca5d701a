"""Shared MAF machinery: binomial weights, Lemma 1 (remove <= add), Balle et al. 2020 conversion, validation."""

from __future__ import annotations

import numpy as np
import pytest
from dp_accounting import rdp
from scipy.special import logsumexp

from lightning_dp.accounting.moments import (
    DEFAULT_ORDERS,
    epsilon_from_log_moments,
    expm1_minus_x,
    log1p_minus_x,
    log_binomial_weights,
    subsampled_log_moments,
)


@pytest.mark.parametrize("q", [0.0, 1e-4, 0.01, 0.3, 1.0])
def test_binomial_weights_sum_to_one(q: float) -> None:
    log_w = log_binomial_weights(np.array([1, 5, 100, 3000]), q)
    np.testing.assert_allclose(logsumexp(log_w, axis=1), 0.0, atol=1e-10)
    assert np.all(np.isneginf(log_w[0, 3:]))


def test_default_orders_are_sorted_integers() -> None:
    assert DEFAULT_ORDERS[0] == 1 and DEFAULT_ORDERS[-1] == 6000
    assert np.all(np.diff(DEFAULT_ORDERS) > 0)


def _gaussian_log_moments(sigma: float, eta_max: int) -> np.ndarray:
    eta = np.arange(eta_max + 1, dtype=np.float64)
    return eta * (eta - 1.0) / (2.0 * sigma**2)


@pytest.mark.parametrize(("sigma", "q"), [(1.0, 0.01), (0.7, 0.1), (2.0, 0.5)])
def test_add_direction_matches_sampled_gaussian_rdp(sigma: float, q: float) -> None:
    """Fed the Gaussian base moments, the add direction is Mironov et al. 2019 (as in dp_accounting)."""
    orders = np.arange(1, 64)
    add = subsampled_log_moments(orders, q, _gaussian_log_moments(sigma, 65))
    ref = rdp.rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian(q, sigma, orders + 1.0)
    np.testing.assert_allclose(add / orders, ref, rtol=1e-9)


@pytest.mark.parametrize("lam", [0.5, 1, 2, 7, 64, 1000, 6000])
def test_lemma1_symmetrised_kernel_nonnegative(lam: float) -> None:
    """Lemma 1 (docs/accountants.md): S(L) = k(1-q+qL) + L k(1-q+q/L) >= 0 for L >= 1, k(y) = y^(lam+1) - y^(-lam).

    Proven analytically; this checks the algebra numerically (log space, relative to the larger term).
    """
    x = np.concatenate([np.geomspace(1e-9, 1.0, 200), np.geomspace(1.001, 1e12, 400)])
    L = 1.0 + x
    for q in np.concatenate([np.geomspace(1e-6, 0.5, 30), np.linspace(0.5, 0.99, 11)]):
        lu = np.log1p(q * x)
        lw = np.log1p(-q * x / L)
        with np.errstate(over="ignore"):
            pos = -lam * lu + np.log(np.expm1((2 * lam + 1) * lu))
            neg = np.log(L) - lam * lw + np.log(-np.expm1((2 * lam + 1) * lw))
        assert np.all(pos - neg >= -1e-9 * np.maximum(1.0, np.abs(pos))), (lam, q)


def test_conversion_matches_dp_accounting() -> None:
    """Balle et al. 2020 conversion == dp_accounting's RDP -> (eps, delta) on the same integer orders."""
    sigma, q, steps, delta = 1.1, 0.02, 500, 1e-5
    orders = np.arange(1, 256)
    add = subsampled_log_moments(orders, q, _gaussian_log_moments(sigma, 257))
    ours = epsilon_from_log_moments(orders, steps * add, delta)
    acc = rdp.RdpAccountant(orders=list(orders + 1.0))
    from dp_accounting import GaussianDpEvent, PoissonSampledDpEvent

    acc.compose(PoissonSampledDpEvent(q, GaussianDpEvent(sigma)), steps)
    assert ours == pytest.approx(acc.get_epsilon(delta), rel=1e-6)


def test_conversion_excludes_infinite_orders() -> None:
    orders = np.array([1, 2, 3])
    finite_only = epsilon_from_log_moments(orders[:2], np.array([0.1, 0.3]), 1e-5)
    assert epsilon_from_log_moments(orders, np.array([0.1, 0.3, np.inf]), 1e-5) == finite_only
    assert epsilon_from_log_moments(orders, np.full(3, np.inf), 1e-5) == np.inf


@pytest.mark.parametrize("delta", [0.0, 1.0, -1e-3, 2.0])
def test_conversion_rejects_bad_delta(delta: float) -> None:
    with pytest.raises(ValueError, match="delta"):
        epsilon_from_log_moments(np.array([1]), np.array([0.1]), delta)


@pytest.mark.parametrize("q", [-0.1, 1.5])
def test_bad_sample_rate(q: float) -> None:
    with pytest.raises(ValueError, match="sample_rate"):
        log_binomial_weights(np.array([2]), q)


@pytest.mark.parametrize("orders", [[0, 1], [1.5], []])
def test_bad_orders(orders: list[float]) -> None:
    with pytest.raises(ValueError, match="orders"):
        log_binomial_weights(np.array(orders), 0.1)


def test_stable_helpers() -> None:
    a = np.array([-3.0, -1e-3, -1e-9, 0.0, 1e-9, 1e-3, 3.0])
    np.testing.assert_allclose(
        expm1_minus_x(a), [np.expm1(v) - v if abs(v) > 1e-2 else v * v / 2 for v in a], rtol=1e-3
    )
    assert np.all(expm1_minus_x(a) >= 0)
    y = np.array([-0.5, -1e-4, 1e-8, 0.2])
    np.testing.assert_allclose(log1p_minus_x(y), np.log1p(y) - y, rtol=1e-6)
