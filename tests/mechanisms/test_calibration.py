"""Calibration (noise parameter for a target epsilon) and the LAP2 / PLRV-O parameter searches."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import special

from lightning_dp.accounting import ACCOUNTANTS, make_accountant
from lightning_dp.accounting.events import GaussianEvent, PoissonSampledEvent
from lightning_dp.mechanisms import calibrate, search_lap2, search_plrv
from lightning_dp.mechanisms.calibration import (
    RTOL,
    calibrate_result,
    closed_form_noise_ratio,
    corollary_d2_shape_bounds,
    gamma_scale_lower_bound,
    mechanism_epsilon,
    solve_monotone,
)
from lightning_dp.mechanisms.gaussian import GaussianMechanism
from lightning_dp.mechanisms.lap2 import Lap2Mechanism
from lightning_dp.mechanisms.plrv import PlrvMechanism


def needs(*names: str) -> pytest.MarkDecorator:
    """Skip until the Laplace-family accountants are registered."""
    missing = sorted(set(names) - set(ACCOUNTANTS))
    return pytest.mark.skipif(bool(missing), reason=f"accountants not registered yet: {missing}")


def in_window(eps: float, target: float) -> bool:
    return (1 - RTOL) * target <= eps <= target


# ---------------------------------------------------------------------------------------------------- root finder


@pytest.mark.parametrize("increasing", [True, False])
def test_solve_monotone_lands_in_window_on_safe_side(increasing: bool) -> None:
    calls: list[float] = []

    def eps(x: float) -> float:
        calls.append(x)
        return 3.0 * x**1.5 if increasing else 3.0 / x**1.5

    x, e = solve_monotone(eps, 2.0, initial=100.0, increasing=increasing)
    assert in_window(e, 2.0) and e == eps(x)
    assert len(calls) < 40


def test_solve_monotone_handles_steps_and_infinity() -> None:
    # step-like (discretised accountant) with infinite epsilon past a pole
    def eps(x: float) -> float:
        return math.inf if x > 5 else math.floor(x * 1000) / 1000

    x, e = solve_monotone(eps, 1.2345, initial=4.9, increasing=True)
    assert e <= 1.2345 and in_window(e, 1.2345)


def test_solve_monotone_unreachable_target_raises() -> None:
    with pytest.raises(ValueError, match="closest"):
        solve_monotone(lambda x: 1.0 + 1.0 / x, 0.5, initial=1.0, increasing=False, bounds=(1e-3, 1e3))


def test_closed_form_initialiser_matches_lap2_sec_iv_b() -> None:
    q, eps, t, delta = 0.01, 2.0, 1000, 1e-5
    assert closed_form_noise_ratio(eps, delta, q, t) == pytest.approx(2 * q / eps * math.sqrt(t * math.log(1 / delta)))


# ------------------------------------------------------------------------------------------------------- Gaussian


def test_gaussian_calibration_within_one_percent_pld() -> None:
    q, steps, delta, target = 0.04, 2250, 1e-5, 7.0
    result = calibrate_result(
        "gaussian", target_epsilon=target, target_delta=delta, sample_rate=q, steps=steps, max_grad_norm=1.5
    )
    mech = result.mechanism
    assert isinstance(mech, GaussianMechanism) and mech.max_grad_norm == 1.5 and result.accountant == "pld"
    eps = make_accountant("pld").compose(PoissonSampledEvent(q, GaussianEvent(mech.noise_multiplier)), steps)
    eps = eps.get_epsilon(delta)
    assert in_window(eps, target) and eps == pytest.approx(result.epsilon)
    assert 1.3 < mech.noise_multiplier < 1.7


@pytest.mark.parametrize(("q", "steps", "target"), [(0.01, 1000, 1.0), (0.1, 100, 8.0), (0.001, 10_000, 0.5)])
def test_gaussian_calibration_rdp(q: float, steps: int, target: float) -> None:
    mech = calibrate(
        "gaussian",
        target_epsilon=target,
        target_delta=1e-5,
        sample_rate=q,
        steps=steps,
        max_grad_norm=1.0,
        accountant="rdp",
    )
    eps = mechanism_epsilon(mech, sample_rate=q, steps=steps, delta=1e-5, accountant="rdp")
    assert in_window(eps, target)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(target_epsilon=0.0), "target_epsilon"),
        (dict(target_delta=1.5), "target_delta"),
        (dict(sample_rate=0.0), "sample_rate"),
        (dict(steps=0), "steps"),
        (dict(max_grad_norm=-1.0), "max_grad_norm"),
        (dict(noise="uniform"), "Unknown noise"),
    ],
)
def test_calibrate_validates_arguments(kwargs: dict, match: str) -> None:
    args = dict(noise="gaussian", target_epsilon=1.0, target_delta=1e-5, sample_rate=0.01, steps=10, max_grad_norm=1.0)
    args.update(kwargs)
    noise = args.pop("noise")
    with pytest.raises(ValueError, match=match):
        calibrate(noise, **args)


@pytest.mark.parametrize("noise", ["lap2", "plrv", "laplace-advanced"])
def test_num_params_required(noise: str) -> None:
    with pytest.raises(ValueError, match="num_params"):
        calibrate(noise, target_epsilon=1.0, target_delta=1e-5, sample_rate=0.01, steps=10, max_grad_norm=1.0)


# ---------------------------------------------------------------------------------------------- Laplace (l1, basic)


def test_literature_review_helpers() -> None:
    """Literature review 3.3 and 4.4 worked examples (eps=3, delta=1e-5, k=1220, C=3)."""
    from lightning_dp.accounting.composition import advanced_laplace_noise_scale, basic_laplace_noise_scale

    assert basic_laplace_noise_scale(3.0, 1220, 3.0)[1] == pytest.approx(1220.0)
    eps0, _, scale = advanced_laplace_noise_scale(3.0, 1e-5, 1220, 3.0)
    assert eps0 == pytest.approx(0.01564, rel=1e-3) and scale == pytest.approx(1198.94, rel=1e-4)


@needs("basic")
def test_laplace_sequential_literature_example() -> None:
    """Literature review 3.3: eps=3, k=1220, C=3, no subsampling -> b = C k / eps = 1220."""
    mech = calibrate("laplace", target_epsilon=3.0, target_delta=0.0, sample_rate=1.0, steps=1220, max_grad_norm=3.0)
    assert mech.noise_scale == pytest.approx(1220.0, rel=RTOL)
    assert mech.noise_scale >= 1220.0 * (1 - 1e-12)  # never less noise than the closed form


@needs("basic")
def test_laplace_subsampled_calibration_inverse() -> None:
    q, steps, target = 0.01, 500, 2.0
    mech = calibrate("laplace", target_epsilon=target, target_delta=1e-5, sample_rate=q, steps=steps, max_grad_norm=1)
    assert in_window(mech_eps(mech, q, steps), target)


def mech_eps(mech, q: float, steps: int, n: int | None = None, delta: float = 1e-5, accountant: str | None = None):
    return mechanism_epsilon(mech, sample_rate=q, steps=steps, delta=delta, num_params=n, accountant=accountant)


# ------------------------------------------------------------------------------------------ Laplace, advanced (4.4)


@needs("advanced")
def test_laplace_advanced_literature_example() -> None:
    """Literature review 4.4: eps=3, delta=1e-5, k=1220, C=3 -> scale ~ 1198.94."""
    result = calibrate_result(
        "laplace-advanced",
        target_epsilon=3.0,
        target_delta=1e-5,
        sample_rate=1.0,
        steps=1220,
        max_grad_norm=3.0,
        num_params=100,
    )
    assert result.accountant == "advanced"
    assert result.mechanism.noise_scale == pytest.approx(1198.94, rel=1e-3)
    assert result.mechanism.name == "laplace-advanced"


@needs("lap2")
def test_laplace_advanced_against_sound_accountant() -> None:
    q, steps, n, target = 0.02, 300, 10_000, 2.0
    mech = calibrate(
        "laplace-advanced",
        target_epsilon=target,
        target_delta=1e-5,
        sample_rate=q,
        steps=steps,
        max_grad_norm=1.0,
        num_params=n,
        accountant="lap2",
    )
    assert in_window(mech_eps(mech, q, steps, n, accountant="lap2"), target)


# ------------------------------------------------------------------------------------------------------------ LAP2


@needs("lap2")
@pytest.mark.parametrize(("q", "steps", "n", "target"), [(0.01, 1000, 26_000, 1.0), (0.004, 5860, 10**8, 3.0)])
def test_lap2_calibration_inverse(q: float, steps: int, n: int, target: float) -> None:
    mech = calibrate(
        "lap2", target_epsilon=target, target_delta=1e-5, sample_rate=q, steps=steps, max_grad_norm=2.0, num_params=n
    )
    assert isinstance(mech, Lap2Mechanism) and mech.max_grad_norm == 2.0
    assert in_window(mech_eps(mech, q, steps, n), target)


@needs("lap2")
def test_search_lap2_largest_clip_and_smallest_scale() -> None:
    q, steps, n, target = 0.01, 500, 50_000, 2.0
    found = search_lap2(target, 1e-5, q, steps, n, max_clip=3.0)
    assert found.max_grad_norm == 3.0 and found.accountant == "lap2"
    assert found.epsilon <= target and in_window(mech_eps(found.mechanism(), q, steps, n), target)
    assert found.initial_noise_scale == pytest.approx(closed_form_noise_ratio(target, 1e-5, q, steps) * 3.0)
    # a smaller b is infeasible at C*: b* is (within tolerance) the smallest feasible scale
    assert mech_eps(Lap2Mechanism(found.noise_scale * 0.97, 3.0), q, steps, n) > target
    # with a cap on b, C shrinks (Alg. 1: the largest C whose smallest feasible b is below b_max)
    capped = search_lap2(target, 1e-5, q, steps, n, max_clip=3.0, max_noise_scale=found.noise_scale / 2)
    assert capped.noise_scale == pytest.approx(found.noise_scale / 2)
    assert capped.max_grad_norm == pytest.approx(1.5, rel=1e-9) and capped.epsilon <= target
    assert capped.snr == pytest.approx(found.snr)


@needs("lap2-paper")
def test_search_lap2_paper_accountant() -> None:
    found = search_lap2(2.0, 1e-5, 0.01, 300, 1000, accountant="lap2-paper", max_clip=1.0)
    assert found.epsilon <= 2.0 and found.accountant == "lap2-paper"


# ------------------------------------------------------------------------------------------------------------ PLRV


def test_gamma_scale_lower_bound_c1_c4() -> None:
    k = 50.0
    theta = gamma_scale_lower_bound(k, gamma_cdf_tol=0.01, max_distortion=10.0)
    assert special.gammainc(k, 0.1 / theta) <= 0.01 + 1e-12
    assert 1 / ((k - 1) * theta) <= 10.0 + 1e-9
    assert theta == pytest.approx(max(0.1 / special.gammaincinv(k, 0.01), 0.1 / (k - 1)))


def test_corollary_d2_shape_bounds() -> None:
    # the paper's Table 2 configuration: Delta < 0 at eta = 2, so the intersection is empty
    assert corollary_d2_shape_bounds(10.0, 8.32e-4, 100) is None
    # MGF cap violated
    assert corollary_d2_shape_bounds(1.0, 0.6, 1) is None
    # a single order (eta = 2) with C theta = 0.45: the two roots of the corollary, in increasing order
    c_theta, eta = 0.45, 2.0
    log_term, denom = math.log(1 - c_theta), c_theta**2 * (eta - eta**2)
    disc = 16 * log_term**2 + 11.09375 * denom
    roots = sorted([(4 * log_term - s * math.sqrt(disc)) / (2 * denom) for s in (1, -1)])
    assert corollary_d2_shape_bounds(1.0, 0.45, 1) == pytest.approx(tuple(roots))


def check_plrv_constraints(found, target: float, clip_range: tuple[float, float], tol: float = 0.01) -> None:
    k, theta, clip = found.gamma_shape, found.gamma_scale, found.max_grad_norm
    assert found.epsilon <= target  # c2
    assert clip_range[0] <= clip <= clip_range[1]  # c0
    assert found.gamma_cdf == pytest.approx(special.gammainc(k, 0.1 / theta)) and found.gamma_cdf <= tol  # c1
    assert k > 1  # c3
    assert found.distortion <= 10.0 + 1e-9 and theta >= 0.1 / (k - 1) * (1 - 1e-9)  # c4
    assert (found.max_order + 1) * clip * theta < 1  # MGF validity
    assert found.snr == pytest.approx(clip * (k - 1) * theta)


@pytest.mark.parametrize(
    "accountant",
    [
        pytest.param("plrv-paper", marks=needs("plrv-paper")),
        pytest.param("plrv", marks=needs("plrv")),
    ],
)
def test_plrv_calibration_fixed_clip(accountant: str) -> None:
    q, steps, n, target = 0.01, 300, 26_000, 2.0
    result = calibrate_result(
        "plrv",
        target_epsilon=target,
        target_delta=1e-5,
        sample_rate=q,
        steps=steps,
        max_grad_norm=1.0,
        num_params=n,
        accountant=accountant,
    )
    mech = result.mechanism
    assert isinstance(mech, PlrvMechanism) and mech.max_grad_norm == 1.0 and result.accountant == accountant
    eps = mech_eps(mech, q, steps, n, accountant=accountant)
    assert eps == pytest.approx(result.epsilon) and result.epsilon <= target


@pytest.mark.parametrize(
    ("accountant", "q", "steps", "n", "target", "shapes"),
    [
        pytest.param("plrv-paper", 0.01, 300, 26_000, 1.0, (1.001, 1e6), marks=needs("plrv-paper")),
        pytest.param("plrv-paper", 0.01024, 250, 85 * 10**6, 1.7, (1.001, 1e6), marks=needs("plrv-paper")),
        pytest.param("plrv", 0.01024, 250, 10**8, 1.7, (100.0, 1e6), marks=needs("plrv")),
        pytest.param("plrv", 0.01, 300, 26_000, 1.0, (1.001, 1e6), marks=needs("plrv")),
    ],
)
def test_search_plrv_feasible(accountant: str, q: float, steps: int, n: int, target: float, shapes: tuple) -> None:
    found = search_plrv(target, 1e-5, q, steps, n, accountant=accountant, clip_range=(0.5, 1.0), shape_range=shapes)
    check_plrv_constraints(found, target, (0.5, 1.0))
    assert shapes[0] <= found.gamma_shape <= shapes[1] and found.accountant == accountant
    assert mech_eps(found.mechanism(), q, steps, n, accountant=accountant) == pytest.approx(found.epsilon)
    # optimality along the privacy constraint: a 3 % larger theta at the same (k, C) breaks the target or the MGF cap
    bigger = PlrvMechanism(found.gamma_shape, found.gamma_scale * 1.03, found.max_grad_norm)
    over_cap = (found.max_order + 1) * bigger.max_grad_norm * bigger.gamma_scale >= 1
    assert over_cap or mech_eps(bigger, q, steps, n, accountant=accountant) > target


@needs("plrv-paper")
def test_search_plrv_clip_invariance_of_objective() -> None:
    """The accountant depends on (C, theta) only through C*theta, so J is the same for any feasible clip."""
    q, steps, n, target = 0.01, 300, 26_000, 1.0
    wide = search_plrv(target, 1e-5, q, steps, n, accountant="plrv-paper", clip_range=(0.2, 1.0))
    fixed = search_plrv(target, 1e-5, q, steps, n, accountant="plrv-paper", clip_range=(0.4, 0.4))
    assert fixed.max_grad_norm == 0.4
    assert fixed.snr == pytest.approx(wide.snr, rel=0.02)


@needs("plrv-paper")
def test_search_plrv_infeasible_message() -> None:
    """Paper Table 2 setting at eps=0.46 with C in [5, 10]: J < 0.5, so E|z| = C/J > 10 violates c4."""
    with pytest.raises(ValueError, match="c4"):
        search_plrv(0.46, 2e-5, 0.01024, 250, 85 * 10**6, accountant="plrv-paper", clip_range=(5.0, 10.0))


def test_mechanism_epsilon_needs_num_params_for_lap2() -> None:
    with pytest.raises(ValueError, match="num_params"):
        mechanism_epsilon(Lap2Mechanism(1.0, 1.0), sample_rate=0.01, steps=10, delta=1e-5)
    assert np.isfinite(mechanism_epsilon(GaussianMechanism(1.0, 1.0), sample_rate=0.01, steps=10, delta=1e-5))


@pytest.mark.parametrize(("target_epsilon", "warned"), [(1e-3, True), (3.0, False)])
def test_a_calibration_that_drowns_the_signal_says_so(target_epsilon, warned, caplog) -> None:
    """sigma in the hundreds (epsilon 1e-3 over 100 steps at q = 0.05): a warning saying what to change; a usual
    calibration stays silent."""
    with caplog.at_level("WARNING", logger="lightning_dp"):
        mechanism = calibrate(
            "gaussian",
            target_epsilon=target_epsilon,
            target_delta=1e-5,
            sample_rate=0.05,
            steps=100,
            max_grad_norm=1.0,
            accountant="rdp",
        )
    messages = [r.getMessage() for r in caplog.records if "learn nothing useful" in r.getMessage()]
    assert bool(messages) == warned == (mechanism.noise_multiplier > 50)
    if warned:
        assert (
            "larger target epsilon" in messages[0]
            and f"noise_multiplier={mechanism.noise_multiplier:.4g}" in messages[0]
        )
