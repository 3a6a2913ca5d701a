"""The audit's statistics against independent computations: Clopper-Pearson (scipy's binomtest), the approximate-DP
theorem's tail written from binomial survival functions, and Monte Carlo runs of mechanisms whose epsilon is known."""

import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld
from scipy.special import logit
from scipy.stats import binom, binomtest

from lightning_dp.audit import audit_scores, count_correct_guesses, one_run_epsilon_lower_bound, one_run_p_value
from lightning_dp.audit.many_runs import clopper_pearson, many_run_epsilon_lower_bound


@pytest.mark.parametrize(("r", "v"), [(10, 9), (100, 80), (1000, 700), (1000, 1000), (5000, 4990)])
def test_pure_dp_bound_is_the_clopper_pearson_lower_limit(r, v):
    # delta = 0 (pure DP): P[Binomial(r, p) >= v] = beta  <=>  p = one-sided Clopper-Pearson lower limit.
    lower = binomtest(v, r, alternative="greater").proportion_ci(confidence_level=0.95).low
    assert one_run_epsilon_lower_bound(r, r, v, delta=0.0, confidence=0.95) == pytest.approx(logit(lower), abs=1e-5)


def _approx_dp_tail(m, r, v, eps, delta):
    """Steinke et al. 2023's approximate-DP bound with survival functions: f(v) + 2 m delta max_i (f(v-i)-f(v))/i."""
    p = math.exp(eps) / (1 + math.exp(eps))

    def f(k):
        return binom.sf(k - 1, r, p)

    return min(1.0, f(v) + 2 * m * delta * max((f(v - i) - f(v)) / i for i in range(1, v + 1)))


@pytest.mark.parametrize(("m", "r", "v"), [(100, 40, 35), (1000, 200, 170), (2000, 1000, 990)])
@pytest.mark.parametrize("eps", [0.0, 0.5, 2.0, 5.0])
def test_approximate_dp_p_value_matches_theorem_5_2(m, r, v, eps):
    expected = _approx_dp_tail(m, r, v, eps, 1e-5)
    assert one_run_p_value(m, r, v, eps, 1e-5) == pytest.approx(expected, rel=1e-6, abs=1e-12)


def test_bound_sits_where_the_p_value_crosses_beta_and_grows_with_evidence():
    m, r, v, delta = 2000, 1000, 990, 1e-5
    bound = one_run_epsilon_lower_bound(m, r, v, delta=delta, confidence=0.95)
    assert _approx_dp_tail(m, r, v, bound - 1e-3, delta) < 0.05 < _approx_dp_tail(m, r, v, bound + 1e-3, delta)
    assert one_run_epsilon_lower_bound(m, r, v, delta=delta, confidence=0.99) < bound
    assert one_run_epsilon_lower_bound(m, r, v, delta=1e-3, confidence=0.95) < bound
    assert one_run_epsilon_lower_bound(m, r, 500, delta=delta) == 0.0  # chance accuracy proves nothing


def test_randomized_response_bound_covers_and_approaches_the_true_epsilon():
    # eps-DP randomized response on every canary: the guesses are correct with probability e^eps / (1 + e^eps).
    rng = np.random.default_rng(0)
    eps, m, trials = 1.0, 5000, 200
    correct = rng.binomial(m, math.exp(eps) / (1 + math.exp(eps)), size=trials)
    bounds = np.array([one_run_epsilon_lower_bound(m, m, int(v), delta=0.0) for v in correct])
    assert (bounds > eps).mean() <= 0.05 + 3 * math.sqrt(0.05 * 0.95 / trials)
    assert np.median(bounds) > 0.9 * eps


def test_guessing_counts_top_as_in_and_bottom_as_out():
    scores = np.array([5.0, -1.0, 3.0, 0.0, -4.0, 2.0])
    included = np.array([True, False, False, True, False, True])
    # top 2 (5.0, 3.0): one right; bottom 2 (-4.0, -1.0): both right.
    assert count_correct_guesses(scores, included, 2, 2) == 3
    included = np.arange(40) % 2 == 0
    scores = 10.0 * included + np.linspace(0, 1, 40)  # perfectly separated
    result = audit_scores(scores, included, delta=0.0, guess_sets=[(2, 2), (10, 10)])
    assert (result.guesses, result.correct, result.k_plus) == (20, 20, 10)  # the set with the most evidence wins
    # ... each set evaluated at the Bonferroni-corrected confidence 1 - 0.05 / 2
    assert result.epsilon_lower_bound == pytest.approx(
        one_run_epsilon_lower_bound(40, 20, 20, delta=0.0, confidence=1 - 0.05 / 2), abs=1e-6
    )


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: one_run_p_value(10, 11, 5, 1.0, 0.0), "guesses"),
        (lambda: one_run_p_value(10, 5, 6, 1.0, 0.0), "correct"),
        (lambda: one_run_p_value(10, 5, 3, -1.0, 0.0), "epsilon"),
        (lambda: one_run_epsilon_lower_bound(10, 5, 3, delta=1.0), "delta"),
        (lambda: one_run_epsilon_lower_bound(10, 5, 3, delta=0.0, confidence=1.0), "confidence"),
        (lambda: count_correct_guesses(np.zeros(3), np.zeros(3, bool), 2, 2), "k_plus"),
        (lambda: count_correct_guesses(np.zeros(3), np.zeros(4, bool), 1, 1), "equal length"),
        (lambda: audit_scores(np.zeros(3), np.zeros(3, bool), delta=0.0, guess_sets=[]), "guess_sets"),
    ],
)
def test_bad_inputs_fail_with_a_message(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_clopper_pearson_matches_scipy_binomtest():
    lower, upper = clopper_pearson(30, 100, 0.975)
    assert lower == pytest.approx(binomtest(30, 100, alternative="greater").proportion_ci(0.975).low)
    assert upper == pytest.approx(binomtest(30, 100, alternative="less").proportion_ci(0.975).high)
    assert clopper_pearson(0, 10, 0.95)[0] == 0.0 and clopper_pearson(10, 10, 0.95)[1] == 1.0


def _gaussian_epsilon(sigma, delta):
    """Exact epsilon of one Gaussian mechanism with sensitivity 1 (dp-accounting's PLD)."""
    return pld.from_gaussian_mechanism(sigma, value_discretization_interval=1e-3).get_epsilon_for_delta(delta)


@pytest.mark.parametrize("scale", [1.0, 0.1])
def test_many_run_audit_of_a_gaussian_mechanism(scale):
    # 20000 "runs" of N(1, s^2) (canary in) and N(0, s^2) (out); the claim is sigma = 1. At scale 0.1 the
    # released noise is a tenth of the claimed one, and the audit must refute the claim.
    rng = np.random.default_rng(1)
    sigma, delta, n = 1.0, 1e-5, 20000
    claimed = _gaussian_epsilon(sigma, delta)
    s = scale * sigma
    threshold = 5 * s if scale < 1 else 2.5  # fixed in advance, from the mechanism's form
    bound = many_run_epsilon_lower_bound(
        1 + s * rng.standard_normal(n), s * rng.standard_normal(n), threshold=threshold, delta=delta
    )
    if scale == 1.0:
        assert 1.0 < bound < claimed
    else:
        assert bound > claimed
