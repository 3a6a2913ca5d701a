"""The ``blt-minsep`` accountant against independent computations: the sensitivity against a brute-force maximum over
every b-separated participation pattern of the dense ``C``, and epsilon against the analytic Gaussian mechanism
(Balle and Wang 2018, Theorem 8, with scipy), per segment and across segments."""

from __future__ import annotations

import math

import pytest
from correlation_helpers import analytic_gaussian_epsilon, brute_force_sensitivity

from lightning_dp.accounting import make_accountant
from lightning_dp.accounting.base import Accountant
from lightning_dp.accounting.blt_minsep import BLTMinSepAccountant, BLTMinSepEvent, blt_sensitivity
from lightning_dp.correlated_noise import BufferedToeplitz, optimize_blt

HAND = BufferedToeplitz((0.9, 0.5), (0.3, 0.2))  # positive, sum of scales < 1: monotone


@pytest.mark.parametrize("n, min_sep", [(9, 1), (9, 2), (12, 3), (12, 5), (10, 10)])
@pytest.mark.parametrize("which", ["hand", "optimised"])
def test_sensitivity_is_the_brute_force_maximum(n, min_sep, which):
    strategy = HAND if which == "hand" else optimize_blt(n, 2, min_sep=min_sep)
    assert strategy.is_monotone()
    assert blt_sensitivity(strategy, n, min_sep) == pytest.approx(brute_force_sensitivity(strategy, n, min_sep))


@pytest.mark.parametrize("sigma, steps, min_sep", [(2.0, 12, 3), (0.8, 10, 1), (5.0, 30, 7)])
def test_epsilon_is_the_analytic_gaussian_of_sigma_over_the_sensitivity(sigma, steps, min_sep):
    accountant = make_accountant("blt-minsep")
    assert isinstance(accountant, BLTMinSepAccountant)
    event = BLTMinSepEvent(sigma, min_sep, HAND.decays, HAND.scales)
    for step in range(1, steps + 1):  # the epsilon of prefixes: the leading blocks of C
        accountant.compose(event)
        if step not in (1, 2, min_sep + 1, steps):
            continue
        mu = blt_sensitivity(HAND, step, min_sep) / sigma
        expected = analytic_gaussian_epsilon(mu, 1e-5)
        assert expected * (1 - 1e-9) <= accountant.get_epsilon(1e-5) <= expected * (1 + 2e-3) + 1e-3  # PLD: pessimistic
    assert accountant.participations == math.ceil(steps / min_sep)


def test_segments_compose_as_gaussians():
    """Two segments of 7 and 5 steps (a resume): sensitivity sqrt(sens_7^2 + sens_5^2), participations 3 + 2."""
    event = BLTMinSepEvent(3.0, 3, HAND.decays, HAND.scales)
    accountant = BLTMinSepAccountant().compose(event, 7)
    accountant.compose(BLTMinSepEvent(3.0, 3, HAND.decays, HAND.scales, segment=1), 5)
    sens = math.hypot(brute_force_sensitivity(HAND, 7, 3), brute_force_sensitivity(HAND, 5, 3))
    assert accountant.sensitivity == pytest.approx(sens) and accountant.participations == 3 + 2
    expected = analytic_gaussian_epsilon(sens / 3.0, 1e-6)
    assert expected * (1 - 1e-9) <= accountant.get_epsilon(1e-6) <= expected * (1 + 2e-3) + 1e-3


def test_the_ledger_is_json_and_refuses_a_change_of_parameters():
    accountant = BLTMinSepAccountant().compose(BLTMinSepEvent(1.5, 4, HAND.decays, HAND.scales), 6)
    state = accountant.state_dict()
    restored = BLTMinSepAccountant()
    restored.load_state_dict(state)
    assert restored.ledger == accountant.ledger and restored.get_epsilon(1e-5) == accountant.get_epsilon(1e-5)
    for changed in (
        BLTMinSepEvent(1.6, 4, HAND.decays, HAND.scales),
        BLTMinSepEvent(1.5, 5, HAND.decays, HAND.scales),
        BLTMinSepEvent(1.5, 4, (0.9, 0.4), HAND.scales),
    ):
        with pytest.raises(ValueError, match=r"the sample rate \(b = floor\(1 / q\)\) and C fixed for the run"):
            accountant.copy().compose(changed)
    with pytest.raises(ValueError, match="segments come in order"):
        accountant.copy().compose(BLTMinSepEvent(1.5, 4, HAND.decays, HAND.scales, segment=2)).compose(
            BLTMinSepEvent(1.5, 4, HAND.decays, HAND.scales, segment=1)
        )


def test_no_noise_is_no_guarantee_and_other_events_are_refused():
    assert BLTMinSepAccountant().compose(BLTMinSepEvent(0.0, 2, HAND.decays, HAND.scales), 3).get_epsilon(1e-5) == (
        math.inf
    )
    accountant: Accountant = BLTMinSepAccountant()
    with pytest.raises(ValueError, match="does not support"):
        accountant.compose("a Gaussian step")
    with pytest.raises(ValueError, match="num_groups"):
        accountant.compose(BLTMinSepEvent(1.0, 0, HAND.decays, HAND.scales))
