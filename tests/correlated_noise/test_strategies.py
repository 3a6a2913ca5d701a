"""Strategies and workloads against their dense matrices: ``C^{-1} C = I``, the BLT's closed-form inverse, the
workload matrices, and bad inputs failing early."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_dp.correlated_noise import sensitivity, toeplitz
from lightning_dp.correlated_noise.strategies import BandedToeplitz, BufferedToeplitz, check_band, check_buffers
from lightning_dp.correlated_noise.workloads import Workload

N = 17
BANDED = [BandedToeplitz((1.0,)), BandedToeplitz((1.0, 0.5, 0.3)), BandedToeplitz((1.0, -0.7, 0.2, 0.05))]
BLTS = [BufferedToeplitz((0.9,), (0.4,)), BufferedToeplitz((0.95, 0.5, 0.1), (0.2, 0.3, 0.1))]


@pytest.mark.parametrize("strategy", BANDED + BLTS, ids=repr)
def test_dense_inverse_is_the_inverse(strategy):
    c = strategy.dense(N)
    assert np.allclose(strategy.inverse_dense(N) @ c, np.eye(N), atol=1e-12)
    assert np.allclose(c, np.tril(c)) and c[0, 0] == 1.0
    assert np.allclose(strategy.column_norms(N), np.linalg.norm(c, axis=0))


def test_banded_layout():
    c = BandedToeplitz((1.0, 0.5, 0.25)).dense(5)
    assert c[2, 0] == 0.25 and c[3, 0] == 0.0 and c[4, 2] == 0.25 and np.all(np.diag(c) == 1.0)
    assert BandedToeplitz.identity().band == 1 and np.array_equal(BandedToeplitz.identity().dense(4), np.eye(4))


def test_blt_coefficients_follow_the_parameterisation():
    blt = BLTS[1]
    theta, w = np.array(blt.decays), np.array(blt.scales)
    expected = [1.0] + [float(np.sum(w * theta ** (k - 1))) for k in range(1, N)]
    assert np.allclose(blt.toeplitz_coefs(N), expected, rtol=0, atol=1e-15)


@pytest.mark.parametrize("blt", BLTS, ids=repr)
def test_blt_inverse_in_closed_form(blt):
    inverse = blt.inverse()
    assert inverse.num_buffers == blt.num_buffers
    assert np.allclose(inverse.toeplitz_coefs(200), blt.inverse_coefs(200), rtol=0, atol=1e-12)
    assert np.allclose(inverse.inverse().toeplitz_coefs(50), blt.toeplitz_coefs(50), rtol=0, atol=1e-10)
    # positive scales: the inverse's decays interlace with the decays (one below the smallest)
    lam, theta = np.sort(inverse.decays), np.sort(blt.decays)
    assert np.all(lam < theta) and np.all(lam[1:] > theta[:-1])


def test_toeplitz_products_and_inverses():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=9), rng.normal(size=5)
    a[0] = 2.0
    assert np.allclose(
        toeplitz.materialize(toeplitz.multiply(a, b, 9), 9), toeplitz.materialize(a, 9) @ toeplitz.materialize(b, 9)
    )
    assert np.allclose(toeplitz.materialize(toeplitz.inverse_coefs(a, 9), 9), np.linalg.inv(toeplitz.materialize(a, 9)))


def test_workload_matrices():
    n, beta = 7, 0.8
    prefix = Workload(n).matrix()
    assert np.array_equal(prefix, np.tril(np.ones((n, n))))
    momentum = np.array([[beta ** (r - s) if r >= s else 0.0 for s in range(n)] for r in range(n)])
    assert np.allclose(Workload(n, beta).matrix(), np.tril(np.ones((n, n))) @ momentum)
    rates = np.linspace(1.0, 0.2, n)
    assert np.allclose(
        Workload.with_schedule(rates, beta).matrix(), np.tril(np.ones((n, n))) @ np.diag(rates) @ momentum
    )
    assert hash(Workload(n, beta)) == hash(Workload(n, beta))


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: BandedToeplitz(()), "band b >= 1"),
        (lambda: BandedToeplitz((2.0, 1.0)), "coefs / coefs\\[0\\]"),
        (lambda: BandedToeplitz((1.0, float("nan"))), "finite"),
        (lambda: BufferedToeplitz((), ()), "d >= 1"),
        (lambda: BufferedToeplitz((0.5, 0.2), (0.1,)), "same length"),
        (lambda: BufferedToeplitz((0.5, 0.5), (0.1, 0.2)).inverse(), "distinct"),
        (lambda: check_band(0, 8), "b must be an integer in \\[1, n=8\\]"),
        (lambda: check_band(9, 8), "b must be an integer in \\[1, n=8\\]"),
        (lambda: check_buffers(0), "d must be an integer >= 1"),
        (lambda: Workload(0), "positive integer"),
        (lambda: Workload(4, momentum=1.0), "momentum must be in \\[0, 1\\)"),
        (lambda: Workload(4, learning_rates=(1.0, 1.0)), "4 finite values >= 0, not all 0"),
        (lambda: Workload(2, learning_rates=(0.0, 0.0)), "2 finite values >= 0, not all 0"),
        (lambda: toeplitz.inverse_coefs([0.0, 1.0], 3), "singular"),
        (lambda: toeplitz.pad_coefs([1.0] * 40 + [float("inf")], 50), "finite, got inf at index 40"),
        (lambda: BufferedToeplitz(tuple(np.linspace(0.1, 0.9, 12)) + (0.9,), (0.1,) * 13).inverse(), "distinct"),
        (lambda: sensitivity.minsep_sensitivity([1.0], 5, None), "min_sep must be an integer >= 1"),  # type: ignore[arg-type]
        (lambda: sensitivity.minsep_sensitivity([1.0], 5, 2.5), "min_sep must be an integer >= 1"),
        (lambda: sensitivity.minsep_sensitivity([1.0], "5", 1), "positive integer"),  # type: ignore[arg-type]
        (lambda: check_band(True, 8), "b must be an integer"),
    ],
)
def test_bad_input_fails_early_with_one_line(build, message):
    with pytest.raises(ValueError, match=message) as info:
        build()
    assert "\n" not in str(info.value)
