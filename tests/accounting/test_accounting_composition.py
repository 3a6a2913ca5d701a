"""Composition accountants (``basic``, ``advanced``), the literature review's worked examples, and a check of the
review's per-step (eps0, delta0) claim for Laplace noise with l2 sensitivity."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib

from lightning_dp.accounting import (
    advanced_laplace_noise_scale,
    basic_laplace_noise_scale,
    epsilon_for,
    make_accountant,
)
from lightning_dp.accounting.composition import advanced_composition_epsilon, lap2_step_epsilon
from lightning_dp.accounting.events import GaussianEvent, Lap2Event, LaplaceEvent, PoissonSampledEvent


def test_review_sequential_example() -> None:
    """Literature review 3.3 / 7.4: eps = 3, k = 1220, C = 3 -> eps_step = 0.00246, scale 1220."""
    eps_step, scale = basic_laplace_noise_scale(3.0, 1220, 3.0)
    assert eps_step == pytest.approx(0.00246, rel=1e-3) and scale == pytest.approx(1220.0, rel=1e-12)
    assert epsilon_for(LaplaceEvent(scale, 3.0), 1220, 0.0, "basic") == pytest.approx(3.0, rel=1e-12)


def test_review_advanced_example() -> None:
    """Literature review 4.4 / 7.4: eps = 3, delta = 1e-5, k = 1220, C = 3 -> eps0 0.01564, scale 1198.94."""
    eps0, delta0, scale = advanced_laplace_noise_scale(3.0, 1e-5, 1220, 3.0)
    assert eps0 == pytest.approx(0.01564, rel=1e-3)
    assert delta0 == pytest.approx(4.1e-9, rel=1e-2)
    assert scale == pytest.approx(1198.94, rel=1e-4)
    assert advanced_composition_epsilon(eps0, 1220, 5e-6) == pytest.approx(3.0, rel=1e-10)
    # Forward: the sound accountant certifies the target at that scale, for any number of coordinates.
    for n in [1, 1000, 10**8]:
        eps = epsilon_for(Lap2Event(scale, 3.0, n), 1220, 1e-5, "advanced")
        assert eps <= 3.0 and (n == 1 or eps >= 2.95)


@pytest.mark.parametrize("n", [1, 10, 1000, 100_000])
def test_review_per_step_claim_against_exact_privacy_profile(n: int) -> None:
    """The review's (eps0, delta0) for Laplace noise is valid here: the exact privacy profile (PLD of the product
    Laplace at the uniform-spread l2-clipped vector) satisfies delta(eps0) <= delta0, and so does the Hoeffding
    bound we use (it holds for every vector of the l2 ball)."""
    eps0, delta0, scale = advanced_laplace_noise_scale(3.0, 1e-5, 1220, 3.0)
    per_coord = pld_lib.from_laplace_mechanism(
        scale, sensitivity=3.0 / math.sqrt(n), value_discretization_interval=1e-6
    )
    profile = per_coord.self_compose(n) if n > 1 else per_coord
    ours = lap2_step_epsilon(scale, 3.0, n, delta0)
    assert ours <= eps0
    assert profile.get_delta_for_epsilon(ours + 2e-6) <= delta0  # + 2 discretisation intervals
    assert profile.get_delta_for_epsilon(eps0) <= delta0


def test_gaussian_formula_is_not_a_laplace_bound_for_large_eps0() -> None:
    """Outside eps0 <= 2 ln 1.25 the review's Gaussian formula need not hold for Laplace noise; the scale helper
    then falls back to the (larger) sound scale, and the forward accountant still certifies the target."""
    eps0, delta0, scale = advanced_laplace_noise_scale(30.0, 1e-5, 3, 1.0)
    assert eps0 > 2 * math.log(1.25)
    review = 1.0 / eps0 * math.sqrt(2 * math.log(1.25 / delta0))
    assert scale >= review
    assert epsilon_for(Lap2Event(scale, 1.0, 10**6), 3, 1e-5, "advanced") <= 30.0 * (1 + 1e-9)


def test_basic_amplification_formula() -> None:
    """Poisson sampling: log(1 + q (e^eps - 1)) per step (Balle et al. 2018 Thm 8)."""
    q, b, C, k = 0.01, 2.0, 1.0, 50
    expected = k * math.log1p(q * math.expm1(C / b))
    assert epsilon_for(PoissonSampledEvent(q, LaplaceEvent(b, C)), k, 1e-5, "basic") == pytest.approx(expected)
    assert epsilon_for(Lap2Event(b, C, 16), 1, 0.0, "basic") == pytest.approx(4 * C / b)
    assert make_accountant("basic").pure


def test_basic_sampled_scale_inverts() -> None:
    _, scale = basic_laplace_noise_scale(2.0, 100, 1.5, sample_rate=0.05)
    assert epsilon_for(PoissonSampledEvent(0.05, LaplaceEvent(scale, 1.5)), 100, 0.0, "basic") == pytest.approx(2.0)


def test_advanced_with_sampling_is_consistent() -> None:
    eps0, delta0, scale = advanced_laplace_noise_scale(2.0, 1e-5, 500, 1.0, sample_rate=0.1)
    eps = epsilon_for(PoissonSampledEvent(0.1, Lap2Event(scale, 1.0, 10**6)), 500, 1e-5, "advanced")
    assert eps <= 2.0 * (1 + 1e-9)


def test_advanced_is_sound_against_lap2_moments_accountant() -> None:
    """Same noise, no subsampling: both are valid; the moments accountant should be at least as tight here."""
    _, _, scale = advanced_laplace_noise_scale(3.0, 1e-5, 1220, 3.0)
    adv = epsilon_for(Lap2Event(scale, 3.0, 10**6), 1220, 1e-5, "advanced")
    lap2 = epsilon_for(Lap2Event(scale, 3.0, 10**6), 1220, 1e-5, "lap2")
    assert lap2 <= adv


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: basic_laplace_noise_scale(0.0, 10, 1.0), "epsilon"),
        (lambda: basic_laplace_noise_scale(1.0, 0, 1.0), "steps"),
        (lambda: basic_laplace_noise_scale(1.0, 10, -1.0), "max_grad_norm"),
        (lambda: basic_laplace_noise_scale(1.0, 10, 1.0, sample_rate=0.0), "sample_rate"),
        (lambda: advanced_laplace_noise_scale(1.0, 1.0, 10, 1.0), "delta"),
        (lambda: advanced_laplace_noise_scale(1.0, 0.0, 10, 1.0), "delta"),
        (lambda: advanced_laplace_noise_scale(-1.0, 1e-5, 10, 1.0), "epsilon"),
        (lambda: advanced_laplace_noise_scale(1.0, 1e-5, 10, 1.0, sample_rate=1.5), "sample_rate"),
        (lambda: epsilon_for(LaplaceEvent(0.0, 1.0), 3, 0.0, "basic"), "noise_scale"),
        (lambda: epsilon_for(Lap2Event(1.0, 1.0, 3), 3, 1.5, "advanced"), "delta"),
        (lambda: make_accountant("advanced").compose(GaussianEvent(1.0)), "does not support"),
        (lambda: make_accountant("nope"), "Unknown accountant"),
    ],
)
def test_validation(call: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()  # type: ignore[operator]


def test_heterogeneous_ledger() -> None:
    acc = make_accountant("advanced")
    acc.compose(Lap2Event(50.0, 1.0, 100), 10).compose(PoissonSampledEvent(0.1, LaplaceEvent(5.0, 1.0)), 20)
    eps = acc.get_epsilon(1e-5)
    basic = make_accountant("basic")
    basic.compose(PoissonSampledEvent(0.1, LaplaceEvent(5.0, 1.0)), 20)
    assert 0.0 < eps and np.isfinite(eps)
    assert eps <= basic.get_epsilon(0.0) + 10 * math.sqrt(100) / 50.0
