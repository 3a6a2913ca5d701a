"""A search's one epsilon is dp-accounting's RDP accountant on ``RepeatAndSelectDpEvent``, built here by hand; a target
epsilon is met from below; what dp-accounting does not cover is refused."""

from __future__ import annotations

import math

import pytest
from dp_accounting import dp_event, rdp

from lightning_dp.accounting.gaussian import RDPAccountant
from lightning_dp.mechanisms.solver import RTOL
from lightning_dp.tuning import RepetitionDistribution, SearchPlan

SCHEDULE = {"sample_rate": 0.05, "steps": 400, "target_delta": 1e-5}


def direct_epsilon(sigma: float, mean: float | None, shape: float | None) -> float:
    """dp-accounting on the events written out: ``steps`` Poisson-sampled Gaussian steps, repeated and selected."""
    step = dp_event.PoissonSampledDpEvent(SCHEDULE["sample_rate"], dp_event.GaussianDpEvent(sigma))
    event = dp_event.SelfComposedDpEvent(step, SCHEDULE["steps"])
    if mean is not None:
        event = dp_event.RepeatAndSelectDpEvent(event, mean, shape)
    return rdp.RdpAccountant(orders=RDPAccountant.orders).compose(event).get_epsilon(SCHEDULE["target_delta"])


@pytest.mark.parametrize("shape", [1.0, 0.0, 0.5, 2.0, math.inf])
def test_the_search_s_epsilon_is_dp_accounting_s_on_repeat_and_select(shape):
    plan = SearchPlan(1.1, repetitions=RepetitionDistribution(5.0, shape), **SCHEDULE)
    assert plan.epsilon == direct_epsilon(1.1, 5.0, shape)
    assert plan.candidate_epsilon == direct_epsilon(1.1, None, None)
    assert plan.epsilon > plan.candidate_epsilon  # the search costs more than one of its runs ...
    assert plan.epsilon < 5 * plan.candidate_epsilon  # ... and far less than 5 of them composed


def test_a_target_epsilon_is_met_from_below_for_the_whole_search():
    repetitions = RepetitionDistribution(10.0, 1.0)
    plan = SearchPlan.for_target_epsilon(2.0, repetitions=repetitions, **SCHEDULE)
    assert (1 - RTOL) * 2.0 <= plan.epsilon <= 2.0
    assert plan.epsilon == direct_epsilon(plan.noise_multiplier, 10.0, 1.0)
    single = SearchPlan.for_target_epsilon(2.0, repetitions=RepetitionDistribution(1.5, 1.0), **SCHEDULE)
    assert plan.noise_multiplier > single.noise_multiplier  # more candidates on average: more noise each


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"repetitions": RepetitionDistribution(3.0, -0.5)}, "RepeatAndSelectDpEvent covers shape >= 0 only"),
        ({"noise_multiplier": 0.0}, "noise_multiplier must be a positive finite number"),
        ({"sample_rate": 1.5}, r"sample_rate must lie in \(0, 1\]"),
        ({"steps": 2.5}, "steps must be a positive integer"),
        ({"target_delta": 0.0}, r"target_delta must lie in \(0, 1\)"),
    ],
)
def test_bad_plans_are_refused(change, message):
    arguments = {"noise_multiplier": 1.0, "repetitions": RepetitionDistribution(3.0, 1.0), **SCHEDULE, **change}
    with pytest.raises(ValueError, match=message):
        SearchPlan(**arguments)


def test_an_unreachable_target_is_refused_with_the_closest_epsilon():
    with pytest.raises(ValueError, match="reaches epsilon 1e-05"):
        SearchPlan.for_target_epsilon(1e-5, repetitions=RepetitionDistribution(3.0, 1.0), **SCHEDULE)


@pytest.mark.parametrize(
    ("mean", "shape", "sigma", "candidate"), [(3.0, 1.0, 3.121, 1.83), (10.0, math.inf, 4.092, 1.33)]
)
def test_the_rows_of_the_table_in_docs_tuning(mean, shape, sigma, candidate):
    """docs/tuning.md, "Choosing the mean and the shape": the digits schedule held to epsilon 3."""
    plan = SearchPlan.for_target_epsilon(
        3.0, sample_rate=128 / 1258, steps=150, target_delta=1e-5, repetitions=RepetitionDistribution(mean, shape)
    )
    assert round(plan.noise_multiplier, 3) == sigma and round(plan.candidate_epsilon, 2) == candidate
