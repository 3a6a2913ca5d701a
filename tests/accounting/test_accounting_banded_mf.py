"""The banded-MF cyclic-Poisson accountant against independent references: dp-accounting directly on the reduced
mechanism, the library's ``pld`` accountant (b = 1, C = I), the analytic Gaussian mechanism (q_b = 1, Balle and Wang
2018) and a dense-matrix computation of the unsubsampled mechanism's exact privacy loss."""

import json
import math
from dataclasses import replace as dataclasses_replace

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld
from scipy import optimize, special

from lightning_dp.accounting import GaussianEvent, PoissonSampledEvent, make_accountant
from lightning_dp.accounting.banded_mf import (
    BandedMFAccountant,
    BandedMFEvent,
    band_and_max_column_norm,
    banded_mf_epsilon,
)
from lightning_dp.correlated_noise.strategies import BandedToeplitz, BufferedToeplitz
from lightning_dp.mechanisms.calibration_banded import calibrate_banded_mf_noise
from lightning_dp.mechanisms.solver import RTOL

DELTA = 1e-5
STRATEGY = BandedToeplitz((1.0, 0.6, 0.3, 0.1))  # band 4, max column norm sqrt(1.46)


def reference_epsilon(q: float, noise_multiplier: float, k: int, delta: float = DELTA) -> float:
    """dp-accounting directly: PoissonSampled(q, Gaussian(noise_multiplier)) composed k times, grid 1e-4."""
    accountant = pld.PLDAccountant(value_discretization_interval=1e-4)
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(noise_multiplier))
    return accountant.compose(dp_accounting.SelfComposedDpEvent(event, k)).get_epsilon(delta)


def gaussian_delta(epsilon: float, mu: float) -> float:
    """Exact delta(epsilon) of the Gaussian mechanism with sensitivity / noise = mu (Balle and Wang 2018, Thm 8)."""
    return float(special.ndtr(mu / 2 - epsilon / mu) - math.exp(epsilon) * special.ndtr(-mu / 2 - epsilon / mu))


def gaussian_epsilon(delta: float, mu: float) -> float:
    return float(optimize.brentq(lambda e: gaussian_delta(e, mu) - delta, 1e-9, 200.0, xtol=1e-12))


def test_band_one_identity_is_dp_sgd_under_the_pld_accountant():
    sigma, q, steps = 1.1, 0.02, 700
    ours = BandedMFAccountant.for_strategy(
        BandedToeplitz.identity(), steps=steps, noise_multiplier=sigma, group_sample_rate=q
    ).get_epsilon(DELTA)
    dp_sgd = make_accountant("pld").compose(PoissonSampledEvent(q, GaussianEvent(sigma)), steps).get_epsilon(DELTA)
    assert ours == pytest.approx(dp_sgd, rel=1e-9)


def test_matches_dp_accounting_on_the_reduced_mechanism():
    steps, sigma, q_b = 203, 1.5, 0.05  # 203 = 4 * 50 + 3: k = 51
    s = float(np.linalg.norm(STRATEGY.coefs))
    accountant = BandedMFAccountant.for_strategy(STRATEGY, steps=steps, noise_multiplier=sigma, group_sample_rate=q_b)
    assert accountant.participations == 51
    expected = reference_epsilon(q_b, sigma / s, 51)
    assert accountant.get_epsilon(DELTA) == pytest.approx(expected, rel=1e-9)
    # delta(epsilon) is the inverse, up to the PLD's discretisation
    assert accountant.get_delta(expected) == pytest.approx(DELTA, rel=0.02)


def test_participations_when_n_is_not_a_multiple_of_b():
    # group g takes part at the steps t = g mod 4 below n: at most ceil(n / 4) times (group 0)
    for n in (1, 4, 5, 100, 101, 103, 104, 105):
        most = max(len(range(g, n, 4)) for g in range(4))
        accountant = BandedMFAccountant().compose(BandedMFEvent(1.0, 0.1, 4, 1.0), n)
        assert accountant.participations == most == math.ceil(n / 4)
    kwargs = {"noise_multiplier": 2.0, "group_sample_rate": 0.1}
    eps = {n: banded_mf_epsilon(STRATEGY, steps=n, delta=DELTA, **kwargs) for n in (100, 101, 104, 105)}
    assert eps[101] == eps[104] > eps[100]  # 26 participations for n = 101..104, 25 for 100
    assert eps[105] > eps[104]


def test_more_steps_or_a_larger_column_norm_never_lower_epsilon():
    kwargs = {"noise_multiplier": 1.2, "group_sample_rate": 0.08}
    by_steps = [banded_mf_epsilon(STRATEGY, steps=n, delta=DELTA, **kwargs) for n in (8, 40, 41, 120)]
    assert all(a <= b for a, b in zip(by_steps, by_steps[1:], strict=False))
    scaled = [BandedToeplitz((1.0, c, c / 2)) for c in (0.0, 0.3, 0.7, 1.2)]
    by_norm = [banded_mf_epsilon(s, steps=60, delta=DELTA, num_groups=3, **kwargs) for s in scaled]
    assert all(a < b for a, b in zip(by_norm, by_norm[1:], strict=False))


def test_full_participation_is_the_analytic_gaussian_mechanism():
    # q_b = 1: no amplification; k Gaussian mechanisms with sensitivity s compose to mu = sqrt(k) s / sigma.
    steps, sigma = 40, 6.0
    k, s = math.ceil(steps / STRATEGY.band), float(np.linalg.norm(STRATEGY.coefs))
    accountant = BandedMFAccountant.for_strategy(STRATEGY, steps=steps, noise_multiplier=sigma, group_sample_rate=1.0)
    mu = math.sqrt(k) * s / sigma
    exact = gaussian_epsilon(DELTA, mu)
    ours = accountant.get_epsilon(DELTA)
    assert exact <= ours + 1e-9  # pessimistic discretisation: never below the exact value
    assert ours == pytest.approx(exact, abs=2e-3)
    assert accountant.get_delta(1.0) == pytest.approx(gaussian_delta(1.0, mu), rel=1e-2, abs=1e-9)


def test_dense_brute_force_of_the_unsubsampled_mechanism():
    # q_b = 1 and a fixed group g: removing the example shifts C x by C u_g, u_g = sum of e_t over t = g mod b (the
    # columns have disjoint supports, so unit vectors in any directions give the same norm). The exact epsilon is
    # the Gaussian mechanism's at mu_g = ||C u_g|| / sigma; the accountant must bound every group's.
    steps, band, sigma = 22, 3, 4.0
    dense = BandedToeplitz((1.0, -0.5, 0.4)).dense(steps)
    normalised = dense / np.linalg.norm(dense, axis=0)  # column norms all 1: not Toeplitz, still 3-banded
    for matrix in (dense, normalised):
        ours = BandedMFAccountant.for_strategy(
            matrix, steps=steps, noise_multiplier=sigma, group_sample_rate=1.0
        ).get_epsilon(DELTA)
        exact = []
        for g in range(band):
            u = np.zeros(steps)
            u[g::band] = 1.0
            exact.append(gaussian_epsilon(DELTA, float(np.linalg.norm(matrix @ u)) / sigma))
        assert max(exact) <= ours + 1e-9
        if matrix is normalised:  # group 0 has k columns of norm s = 1: the bound is attained
            assert ours == pytest.approx(max(exact), abs=2e-3)


def hockey_stick(epsilon: float, mus: np.ndarray, q: float, points: int = 3001) -> float:
    """max(remove, add) delta(epsilon) of independent Poisson-subsampled Gaussians with shifts ``mus`` (at most 2),
    by the trapezoid rule on a grid over [-9, 9 + max mu] per axis."""
    y = np.linspace(-9.0, 9.0 + float(max(mus)), points)
    weight = np.exp(-(y**2) / 2) / math.sqrt(2 * math.pi) * (y[1] - y[0])
    logs = [np.log1p(-q + q * np.exp(mu * y - mu * mu / 2)) for mu in mus]
    loss, w = (logs[0], weight) if len(mus) == 1 else (logs[0][:, None] + logs[1], weight[:, None] * weight)
    remove = float(np.sum(w * np.clip(np.exp(loss) - math.exp(epsilon), 0.0, None)))
    add = float(np.sum(w * np.clip(1.0 - np.exp(epsilon + loss), 0.0, None)))
    return max(remove, add)


@pytest.mark.parametrize("steps", [3, 4])
def test_dense_brute_force_with_subsampling(steps):
    # q_b < 1, non-adaptive x: removing one example of group g subtracts C[:, P] B, B Bernoulli(q_b) per step of P =
    # {g, g + b, ...}. C^T C on P is diagonal (disjoint supports, read off the dense matrix), so in the orthonormal
    # directions of those columns the release is a product of 1-D subsampled Gaussians with mu_j = ||C[:, j]|| /
    # sigma; its exact delta at our epsilon must not exceed the target (n = 3: the last column of group 0 is cut
    # short, so the bound is loose; n = 4: both columns have norm s, so it is attained).
    band, sigma, q = 2, 1.3, 0.3
    dense = BandedToeplitz((1.0, 0.7)).dense(steps)
    ours = BandedMFAccountant.for_strategy(dense, steps=steps, noise_multiplier=sigma, group_sample_rate=q)
    epsilon = ours.get_epsilon(DELTA)
    deltas = []
    for g in range(band):
        columns = dense[:, g::band]
        gram = columns.T @ columns
        assert np.allclose(gram, np.diag(np.diag(gram)))
        deltas.append(hockey_stick(epsilon, np.sqrt(np.diag(gram)) / sigma, q))
    assert max(deltas) <= DELTA * (1 + 1e-4)
    if steps == 4:
        assert max(deltas) == pytest.approx(DELTA, rel=1e-3)
    else:
        assert max(deltas) < 0.5 * DELTA


def test_band_and_max_column_norm_of_dense_and_toeplitz():
    assert band_and_max_column_norm(STRATEGY, 10) == (4, pytest.approx(math.sqrt(1.46)))
    dense = np.tril(np.ones((6, 6))) - np.tril(np.ones((6, 6)), -2)  # 2-banded
    dense[5, 4] = 3.0
    band, norm = band_and_max_column_norm(dense, 6)
    assert band == 2 and norm == pytest.approx(math.sqrt(10.0))


@pytest.mark.parametrize(
    ("strategy", "kwargs", "match"),
    [
        (BufferedToeplitz((0.9,), (0.3,)), {}, "not banded"),
        (np.triu(np.ones((5, 5))), {}, "lower triangular"),
        (np.eye(4), {}, r"\[n, n\]"),
        (np.zeros((5, 5)), {}, "zero"),
        (BandedToeplitz((1.0, 0.5, 0.2, 0.1, 0.1, 0.1)), {}, "exceeds the number of steps"),
        (STRATEGY, {"num_groups": 2}, "band <= number of groups"),
        (STRATEGY, {"num_groups": 7}, "exceeds the number of steps"),
        (STRATEGY, {"group_sample_rate": 1.2}, r"q_b must lie in \[0, 1\]"),
        (STRATEGY, {"noise_multiplier": -1.0}, "noise_multiplier"),
        (STRATEGY, {"steps": 0}, "positive integer"),
    ],
)
def test_bad_inputs_are_refused(strategy, kwargs, match):
    arguments = {"steps": 5, "noise_multiplier": 1.0, "group_sample_rate": 0.1, **kwargs}
    with pytest.raises(ValueError, match=match):
        BandedMFAccountant.for_strategy(strategy, **arguments)


def test_ledger_refuses_mixed_events_and_other_events():
    event = BandedMFEvent(1.0, 0.1, 4, 1.2)
    accountant = BandedMFAccountant().compose(event, 10)
    with pytest.raises(ValueError, match="same parameters at every step"):
        accountant.compose(BandedMFEvent(2.0, 0.1, 4, 1.2))
    with pytest.raises(ValueError, match="does not support"):
        accountant.compose(GaussianEvent(1.0))
    with pytest.raises(ValueError, match="num_groups"):
        BandedMFAccountant().compose(BandedMFEvent(1.0, 0.1, 0, 1.2))
    with pytest.raises(ValueError, match="max_column_norm"):
        BandedMFAccountant().compose(BandedMFEvent(1.0, 0.1, 2, 0.0))


def test_state_dict_round_trip_and_edge_cases():
    accountant = BandedMFAccountant().compose(BandedMFEvent(1.0, 0.1, 4, 1.2), 37)
    restored = BandedMFAccountant()
    restored.load_state_dict(accountant.state_dict())
    assert restored.ledger == accountant.ledger and restored.get_epsilon(DELTA) == accountant.get_epsilon(DELTA)
    from_numpy = BandedMFAccountant().compose(BandedMFEvent(np.float32(1.0), 0.1, np.int64(4), 1.2), 37)
    assert json.loads(json.dumps(from_numpy.state_dict())) == accountant.state_dict()
    assert BandedMFAccountant().compose(BandedMFEvent(1.0, 0.0, 4, 1.2), 9).get_epsilon(DELTA) == 0.0  # q_b = 0
    assert BandedMFAccountant().get_epsilon(DELTA) == 0.0 and BandedMFAccountant().get_delta(1.0) == 0.0
    no_noise = BandedMFAccountant().compose(BandedMFEvent(0.0, 0.1, 4, 1.0), 8)
    assert no_noise.get_epsilon(DELTA) == math.inf and no_noise.get_delta(1.0) == 1.0
    with pytest.raises(ValueError, match="epsilon must be positive"):
        accountant.get_delta(0.0)


def test_calibration_through_the_generic_solver():
    target = 3.0
    sigma, eps = calibrate_banded_mf_noise(
        STRATEGY, steps=400, group_sample_rate=0.04, target_epsilon=target, target_delta=DELTA
    )
    assert (1 - RTOL) * target <= eps <= target
    assert banded_mf_epsilon(STRATEGY, steps=400, noise_multiplier=sigma, group_sample_rate=0.04, delta=DELTA) == eps
    # sigma / s is DP-SGD's noise multiplier for k = 100 steps at rate q_b, to the solver's tolerance
    s = float(np.linalg.norm(STRATEGY.coefs))
    assert reference_epsilon(0.04, sigma / s, 100) == pytest.approx(eps, rel=1e-9)


def test_segments_compose_their_participations():
    """A restarted correlation (a resume) is a new segment: ``sum_i ceil(n_i / b)`` participations of the reduced
    event; every field but the segment must agree, and segments come in order."""
    event = BandedMFEvent(1.2, 0.1, 4, 1.2)
    accountant = BandedMFAccountant().compose(event, 6).compose(dataclasses_replace(event, segment=1), 5)
    assert accountant.participations == 2 + 2 and accountant.steps == 11
    assert accountant.get_epsilon(DELTA) == reference_epsilon(0.1, 1.0, 4)
    assert BandedMFAccountant().compose(event, 11).participations == 3
    with pytest.raises(ValueError, match="same parameters at every step"):
        accountant.compose(BandedMFEvent(1.2, 0.2, 4, 1.2, segment=1))
    with pytest.raises(ValueError, match="segments come in order"):
        accountant.compose(event)
    with pytest.raises(ValueError, match="segment must be an integer >= 0"):
        BandedMFAccountant().compose(BandedMFEvent(1.0, 0.1, 4, 1.2, segment=-1))
    assert make_accountant("banded-mf").name == "banded-mf"
