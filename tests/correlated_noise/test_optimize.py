"""Strategy optimisation: the objective against dense matrices, the optimum beating DP-SGD (C = I), b = 1 giving
C = I, momentum workloads, the BLT optimiser, and the cache."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_dp.correlated_noise import sensitivity
from lightning_dp.correlated_noise.optimize import optimize_banded, optimize_blt, strategy_error, strategy_loss
from lightning_dp.correlated_noise.strategies import BandedToeplitz, BufferedToeplitz
from lightning_dp.correlated_noise.workloads import Workload

IDENTITY = BandedToeplitz.identity()


@pytest.mark.parametrize(
    "workload",
    [Workload(23), Workload(23, 0.9), Workload.with_schedule(np.linspace(1.0, 0.1, 23), 0.9)],
    ids=["prefix", "momentum", "momentum+decay"],
)
@pytest.mark.parametrize(
    "strategy", [BandedToeplitz((1.0, 0.6, -0.2)), BufferedToeplitz((0.9, 0.2), (0.3, 0.1))], ids=["banded", "blt"]
)
def test_error_matches_the_dense_factorisation(workload, strategy):
    b = workload.matrix() @ strategy.inverse_dense(workload.n)
    assert strategy_error(strategy, workload, "total") == pytest.approx(np.sum(b**2), rel=1e-10)
    assert strategy_error(strategy, workload, "max") == pytest.approx(np.max(np.sum(b**2, axis=1)), rel=1e-10)


@pytest.mark.parametrize("band", [4, 8, 16])
def test_banded_optimum_beats_dp_sgd(band):
    n = 64
    strategy = optimize_banded(n, band)
    assert strategy.band == band and strategy.coefs[0] == 1.0
    workload = Workload(n)
    ratio = strategy_loss(strategy, workload, band) / strategy_loss(IDENTITY, workload, band)
    assert ratio < 0.5  # measured: 0.32 (b = 4), 0.22 (8), 0.17 (16)
    assert sensitivity.minsep_sensitivity_is_exact(strategy.coefs, n, band)


def test_band_one_is_dp_sgd():
    assert optimize_banded(64, 1) == IDENTITY
    assert optimize_banded(64, 1, min_sep=4, workload=Workload(64, 0.9)) == IDENTITY


def test_momentum_and_max_error():
    n, band = 48, 6
    for workload, error in ((Workload(n, 0.9), "total"), (Workload(n), "max")):
        strategy = optimize_banded(n, band, workload=workload, error=error)
        default = optimize_banded(n, band)
        assert strategy != default  # another workload or error gives another optimum
        ours = strategy_loss(strategy, workload, band, error=error)
        assert ours < strategy_loss(IDENTITY, workload, band, error=error)
        assert ours <= strategy_loss(default, workload, band, error=error) * (1 + 1e-9)


def test_learning_rate_schedule():
    n, band = 32, 4
    workload = Workload.with_schedule(np.linspace(1.0, 0.1, n), momentum=0.9)
    strategy = optimize_banded(n, band, workload=workload)
    assert strategy_loss(strategy, workload, band) < 0.8 * strategy_loss(IDENTITY, workload, band)


def test_single_participation_objective_uses_the_coefficient_norm():
    n, band = 32, 4
    strategy = optimize_banded(n, band, max_participations=1)
    expected = strategy_error(strategy, Workload(n)) * float(np.sum(np.square(strategy.coefs)))
    assert strategy_loss(strategy, Workload(n), band, 1) == pytest.approx(expected, rel=1e-12)


def test_blt_optimum_beats_dp_sgd_and_is_monotone():
    n, min_sep = 64, 16
    workload = Workload(n)
    blt = optimize_blt(n, 2, min_sep=min_sep)
    assert blt.num_buffers == 2 and blt.is_monotone()
    ratio = strategy_loss(blt, workload, min_sep) / strategy_loss(IDENTITY, workload, min_sep)
    assert ratio < 0.3  # measured: 0.19
    assert sensitivity.minsep_sensitivity_is_exact(blt.toeplitz_coefs(n), n, min_sep)


def test_results_are_cached():
    assert optimize_banded(64, 8) is optimize_banded(64, 8, min_sep=8)
    assert optimize_blt(32, 1, min_sep=8) is optimize_blt(32, 1, min_sep=8, workload=Workload(32))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: optimize_banded(16, 0), "band b must be an integer in \\[1, n=16\\]"),
        (lambda: optimize_banded(16, 17), "band b must be an integer in \\[1, n=16\\]"),
        (lambda: optimize_banded(16, 4, min_sep=2), "band <= min_sep"),
        (lambda: optimize_banded(16, 4, workload=Workload(8)), "n=8 steps"),
        (lambda: optimize_banded(16, 4, error="mean"), "'total'"),
        (lambda: optimize_blt(16, 0), "d must be an integer >= 1"),
    ],
)
def test_bad_input_fails_early(call, message):
    with pytest.raises(ValueError, match=message) as info:
        call()
    assert "\n" not in str(info.value)
