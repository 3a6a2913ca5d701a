"""The law of the number of candidates: its pmf against the closed forms of Papernot & Steinke 2022 (Definition 1,
Theorem 6) and scipy's distributions, its mean, and draws that pass a chi-square test of goodness of fit."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special, stats

from lightning_dp.tuning.randomness import SearchRandomness
from lightning_dp.tuning.repetitions import RepetitionDistribution

MEAN = 4.0
#: geometric, logarithmic, truncated negative binomial (both sides of 0), Poisson.
SHAPES = [1.0, 0.0, 0.5, 3.0, -0.5, math.inf]


def paper_pmf(distribution: RepetitionDistribution, k: int) -> float:
    """``P[K = k]`` in closed form: Definition 1 (through the generalised binomial coefficient, or scipy's
    truncated negative binomial, geometric and logarithmic laws) and Theorem 6 (Poisson)."""
    eta = distribution.shape
    if eta == math.inf:
        return float(stats.poisson(distribution.mean).pmf(k))
    if k < 1:
        return 0.0
    gamma = distribution.gamma
    if eta == 1:
        return float(stats.geom(gamma).pmf(k))
    if eta == 0:
        return float(stats.logser(1 - gamma).pmf(k))
    if eta > 0:
        negative_binomial = stats.nbinom(eta, gamma)
        return float(negative_binomial.pmf(k) / (1 - negative_binomial.pmf(0)))
    # Gamma(k + eta) / (Gamma(eta) k!), with Gamma(eta) < 0 for eta in (-1, 0): gammaln is log |Gamma|
    magnitude = math.exp(special.gammaln(k + eta) - special.gammaln(eta) - special.gammaln(k + 1))
    return (1 - gamma) ** k / (1 - gamma**-eta) * magnitude


@pytest.mark.parametrize("shape", SHAPES)
def test_the_pmf_is_the_paper_s_and_has_the_mean_asked_for(shape):
    distribution = RepetitionDistribution(MEAN, shape)
    pmf = {k: p for k, p in zip(range(4000), (p for _, p in distribution.probabilities()), strict=False)}
    first = distribution.smallest
    for k in range(first, first + 40):
        assert pmf[k - first] == pytest.approx(paper_pmf(distribution, k), rel=1e-9, abs=1e-300)
        assert distribution.pmf(k) == pytest.approx(paper_pmf(distribution, k), rel=1e-9, abs=1e-300)
    mass = sum(pmf.values())
    mean = sum((k + first) * p for k, p in pmf.items())
    assert mass == pytest.approx(1.0, abs=1e-9)
    assert mean == pytest.approx(MEAN, rel=1e-6)
    assert mean <= MEAN * (1 + 1e-12)  # gamma is found from the safe side (E[K] <= mean)


@pytest.mark.parametrize("shape", SHAPES)
def test_draws_pass_a_chi_square_test(shape):
    distribution = RepetitionDistribution(MEAN, shape)
    randomness = SearchRandomness(seed=20260101)
    draws = np.array([distribution.sample(randomness.uniform()) for _ in range(20_000)])
    assert draws.min() >= distribution.smallest
    # bins k = smallest .. last - 1 and a tail bin, each expecting at least 5 draws
    expected, k = [], distribution.smallest
    while len(draws) * distribution.pmf(k) >= 5 or k < distribution.smallest + 3:
        expected.append(len(draws) * distribution.pmf(k))
        k += 1
    expected.append(len(draws) - sum(expected))
    observed = [np.sum(draws == value) for value in range(distribution.smallest, k)] + [np.sum(draws >= k)]
    assert stats.chisquare(observed, expected).pvalue > 1e-3


def test_gamma_is_the_paper_s_for_the_geometric_law_and_solves_the_mean():
    assert RepetitionDistribution(5.0, 1.0).gamma == pytest.approx(0.2)
    for shape in (0.0, 0.5, 3.0, -0.5):
        gamma = RepetitionDistribution(MEAN, shape).gamma
        mean = (
            (1 - gamma) / (gamma * math.log(1 / gamma))
            if shape == 0
            else shape * (1 - gamma) / gamma / (1 - gamma**shape)
        )
        assert mean == pytest.approx(MEAN, rel=1e-9)


def test_inversion_takes_the_least_k_whose_cdf_exceeds_the_uniform():
    geometric = RepetitionDistribution(2.0, 1.0)  # P[K = k] = 2^-k
    assert geometric.sample(0.0) == 1
    assert geometric.sample(0.4999) == 1
    assert geometric.sample(0.5) == 2
    assert geometric.sample(1 - 2**-53) >= 50  # the far tail ends the walk
    poisson = RepetitionDistribution(2.0, math.inf)
    assert poisson.sample(0.0) == 0 and poisson.sample(math.exp(-2.0) * 0.999) == 0


@pytest.mark.parametrize(
    ("mean", "shape", "message"),
    [
        (1.0, 1.0, "mean_repetitions must be a finite number above 1"),
        (math.inf, 1.0, "mean_repetitions must be a finite number above 1"),
        (3.0, -1.0, "shape must be above -1"),
        (3.0, math.nan, "shape must be above -1"),
    ],
)
def test_bad_parameters_are_refused(mean, shape, message):
    with pytest.raises(ValueError, match=message):
        RepetitionDistribution(mean, shape)
    with pytest.raises(ValueError, match=r"uniform must lie in \[0, 1\)"):
        RepetitionDistribution(3.0, 1.0).sample(1.0)


@pytest.mark.parametrize(
    ("mean", "shape", "scipy_law"),
    [
        (800.0, math.inf, lambda d: stats.poisson(800.0)),  # exp(-800) underflows to 0
        (10_000.0, 200.0, lambda d: stats.nbinom(200.0, d.gamma)),  # gamma^-200 overflows
    ],
)
def test_a_large_mean_draws_vary_and_fit_the_law(mean, shape, scipy_law):
    distribution = RepetitionDistribution(mean, shape)
    law = scipy_law(distribution)
    middle = int(law.median())
    for k in (middle - 100, middle, middle + 100):
        assert distribution.pmf(k) == pytest.approx(law.pmf(k), rel=1e-8)  # truncation at 0: P[0] ~ 0 here
    randomness = SearchRandomness(seed=20260102)
    draws = np.array([distribution.sample(randomness.uniform()) for _ in range(2000)])
    assert len(set(draws)) > 50
    # ten bins of equal expected counts, between the law's deciles
    edges = [int(law.ppf(q)) for q in np.linspace(0.1, 0.9, 9)]
    cdf = [0.0, *(float(law.cdf(edge)) for edge in edges), 1.0]
    expected = np.diff(cdf) * len(draws)
    observed = np.diff([0, *(np.sum(draws <= edge) for edge in edges), len(draws)])
    assert stats.chisquare(observed, expected).pvalue > 1e-3
