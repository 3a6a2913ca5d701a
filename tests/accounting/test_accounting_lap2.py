"""LAP2 accountants: exactness for n = 1, soundness against brute force for n = 2..4, the counterexample
of docs/design.md section 6.3, the fast majorization sum, the CLT limit, and input validation."""

from __future__ import annotations

import itertools
import logging

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import integrate
from scipy.special import logsumexp

from lightning_dp.accounting import epsilon_for, make_accountant
from lightning_dp.accounting.events import GaussianEvent, Lap2Event, PoissonSampledEvent
from lightning_dp.accounting.lap2 import lap2_paper_log_moments, lap2_sound_log_moments, laplace_log_moment
from lightning_dp.accounting.majorization import paper_log_moments, paper_log_moments_direct
from lightning_dp.accounting.moments import log_binomial_weights

_GL_X, _GL_W = np.polynomial.legendre.leggauss(40)


def _coordinate_rule(v: float, b: float) -> tuple[np.ndarray, np.ndarray]:
    """Quadrature rule for the privacy loss ``l = (|o| - |o - v|)/b`` of one coordinate, ``o ~ Lap(0, b)``.

    Atoms ``-v/b`` (mass 1/2) and ``+v/b`` (mass ``e^{-v/b}/2``); on ``0 < o < v`` the loss is ``(2o - v)/b`` with
    density ``e^{-o/b}/(2b)`` (40-node Gauss-Legendre: the integrands below are analytic there).
    """
    if v == 0.0:
        return np.zeros(1), np.zeros(1)
    o = 0.5 * v * (_GL_X + 1.0)
    w = 0.5 * v * _GL_W * np.exp(-o / b) / (2.0 * b)
    loss = np.concatenate([[-v / b, v / b], (2.0 * o - v) / b])
    return loss, np.log(np.concatenate([[0.5, 0.5 * np.exp(-v / b)], w]))


def _exact_moments(g: np.ndarray, b: float, q: float, lam: int) -> tuple[float, float]:
    """Brute-force ``(add, remove)`` MAFs of the Poisson-subsampled product-Laplace mechanism at gradient ``g``.

    add = ``log E_P[(1 - q + q L)^(lam+1)]``, remove = ``log E_P[(1 - q + q L)^(-lam)]``, ``L = Q/P``.
    """
    loss, logp = np.zeros(1), np.zeros(1)
    for gi in g:
        li, lpi = _coordinate_rule(abs(float(gi)), b)
        loss = (loss[:, None] + li[None, :]).ravel()
        logp = (logp[:, None] + lpi[None, :]).ravel()
    log_mix = np.logaddexp(np.log1p(-q), np.log(q) + loss)
    return float(logsumexp(logp + (lam + 1) * log_mix)), float(logsumexp(logp - lam * log_mix))


def _sound_maf(b: float, n: int, q: float, lam: int) -> float:
    return float(lap2_sound_log_moments(PoissonSampledEvent(q, Lap2Event(b, 1.0, n)), (lam,))[0])


def _paper_maf(b: float, n: int, q: float, lam: int) -> float:
    return float(lap2_paper_log_moments(PoissonSampledEvent(q, Lap2Event(b, 1.0, n)), (lam,))[0])


def _log_laplace_F_mp(beta: float, eta: int) -> float:
    """Reference ``log F`` (LAP2 eq. III.5) in 50-digit arithmetic."""
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 50
    b, e = mp.mpf(beta), mp.mpf(eta)
    return float(mp.log((e * mp.exp((e - 1) * b) + (e - 1) * mp.exp(-e * b)) / (2 * e - 1)))


# ------------------------------------------------------------------------------------------------ closed forms


@pytest.mark.parametrize("beta", [1e-7, 1e-3, 0.1, 1.0, 5.0])
@pytest.mark.parametrize("eta", [0, 1, 2, 7, 40])
def test_log_moment_matches_formula_and_integral(beta: float, eta: int) -> None:
    ref = _log_laplace_F_mp(beta, eta)
    assert laplace_log_moment(beta, eta) == pytest.approx(ref, rel=1e-12, abs=1e-300)
    if eta >= 2 and beta >= 1e-3:

        def integrand(o: float) -> float:
            return 0.5 * np.exp(-abs(o) + eta * (abs(o) - abs(o - beta)))

        pieces = [(-np.inf, 0.0), (0.0, beta), (beta, np.inf)]
        integral = sum(integrate.quad(integrand, lo, hi, epsabs=0, epsrel=1e-12, limit=200)[0] for lo, hi in pieces)
        assert laplace_log_moment(beta, eta) == pytest.approx(np.log(integral), rel=1e-7)


def test_log_moment_concave_in_s() -> None:
    """h_eta(s) = log F(sqrt(s), eta) is concave (proof in docs/accountants.md); numerical check on fine grids."""
    s = np.linspace(0.0, 9.0, 4001)
    for eta in [2, 3, 10, 100, 1000, 5000]:
        h = laplace_log_moment(np.sqrt(s), eta)
        assert np.all(np.diff(h, 2) <= 1e-9 * np.abs(h[1:-1]) + 1e-12), eta


@pytest.mark.parametrize(("b", "q"), [(1.0, 0.01), (0.5, 0.1), (2.0, 0.3)])
@pytest.mark.parametrize("lam", [1, 4, 16, 64])
def test_n1_paper_equals_exact_and_sound_bounds_both(b: float, q: float, lam: int) -> None:
    """n = 1: lap2-paper is the exact add-direction MAF; lap2 bounds both directions."""
    add, remove = _exact_moments(np.array([1.0]), b, q, lam)
    assert _paper_maf(b, 1, q, lam) == pytest.approx(add, rel=1e-9, abs=1e-12)
    sound = _sound_maf(b, 1, q, lam)
    assert sound >= add - 1e-12 and sound >= remove - 1e-12


@pytest.mark.parametrize(("b", "q", "steps"), [(1.0, 0.01, 100), (3.0, 0.05, 1000)])
def test_n1_epsilon_dominates_exact_pld(b: float, q: float, steps: int) -> None:
    """n = 1: both accountants' epsilon >= the (tight, both adjacencies) PLD of the subsampled 1-D Laplace."""
    pld = pld_lib.from_laplace_mechanism(b, sensitivity=1.0, sampling_prob=q, value_discretization_interval=1e-4)
    exact = pld.self_compose(steps).get_epsilon_for_delta(1e-5)
    event = PoissonSampledEvent(q, Lap2Event(b, 1.0, 1))
    sound = epsilon_for(event, steps, 1e-5, "lap2")
    paper = epsilon_for(event, steps, 1e-5, "lap2-paper")
    assert exact <= paper * (1 + 1e-12)
    assert paper == pytest.approx(sound, rel=1e-12)  # n = 1: both are the exact worst-case MAF


def test_no_subsampling_equals_exact_laplace_rdp() -> None:
    """q = 1 (laplace-advanced without sampling): MAF = n log F(C/sqrt(n), lambda+1), add = remove by symmetry."""
    for n in [1, 3]:
        for lam in [1, 5, 30]:
            add, remove = _exact_moments(np.full(n, 1.0 / np.sqrt(n)), 0.8, 1.0 - 1e-15, lam)
            sound = float(lap2_sound_log_moments(Lap2Event(0.8, 1.0, n), (lam,))[0])
            assert sound == pytest.approx(add, rel=1e-6)
            assert sound >= remove - 1e-9


# ----------------------------------------------------------------------------- n = 2..4: soundness and paper gap


def _sphere(n: int, m: int) -> list[np.ndarray]:
    """Points of the positive orthant of the unit l2 sphere (by symmetry enough), ``m`` angles per axis."""
    if n == 1:
        return [np.ones(1)]
    out = []
    for t in np.linspace(0.0, np.pi / 2, m):
        out.extend(np.concatenate([[np.cos(t)], np.sin(t) * rest]) for rest in _sphere(n - 1, m))
    return out


@pytest.mark.parametrize(("b", "q"), [(1.0, 0.01), (0.5, 0.01), (1.0, 0.2)])
@pytest.mark.parametrize("n", [2, 3])
def test_sound_dominates_brute_force_over_sphere(b: float, q: float, n: int) -> None:
    grid = _sphere(n, 13 if n == 2 else 7)
    for lam in [2, 8, 32]:
        worst = max(max(_exact_moments(g, b, q, lam)) for g in grid)
        sound = _sound_maf(b, n, q, lam)
        assert sound >= worst * (1 - 1e-9), (n, lam, sound, worst)


def test_sound_add_direction_is_exact_worst_case_n4() -> None:
    """Uniform spread attains the sound add-direction value (the bound is tight); n = 4 brute force."""
    b, q, lam = 1.0, 0.05, 12
    add, remove = _exact_moments(np.full(4, 0.5), b, q, lam)
    log_w = log_binomial_weights(np.array([lam]), q)[0]
    closed = logsumexp(log_w + 4 * laplace_log_moment(0.5 / b, np.arange(lam + 2.0)))
    assert add == pytest.approx(closed, rel=1e-9)
    assert _sound_maf(b, 4, q, lam) >= max(add, remove) * (1 - 1e-12)


@pytest.mark.parametrize(
    ("b", "q", "lam", "n", "paper", "exact"),
    [
        (1.0, 0.01, 8, 2, 0.003715, 0.003977),
        (1.0, 0.01, 32, 2, 0.05791, 0.06849),
        (0.5, 0.01, 32, 2, 0.3653, 1.221),
        (1.0, 0.1, 16, 64, 2.575, 47.45),
    ],
)
def test_design_counterexample_regression(b: float, q: float, lam: int, n: int, paper: float, exact: float) -> None:
    """docs/design.md section 6.3 table: the paper bound falls below the exact moment at g = C/sqrt(n) * ones."""
    assert _paper_maf(b, n, q, lam) == pytest.approx(paper, rel=1e-3)
    log_w = log_binomial_weights(np.array([lam]), q)[0]
    at_uniform = logsumexp(log_w + n * laplace_log_moment(1.0 / (np.sqrt(n) * b), np.arange(lam + 2.0)))
    assert at_uniform == pytest.approx(exact, rel=1e-3)
    if n <= 3:
        assert _exact_moments(np.full(n, 1.0 / np.sqrt(n)), b, q, lam)[0] == pytest.approx(exact, rel=1e-3)
    assert _sound_maf(b, n, q, lam) >= at_uniform


def test_paper_warning_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="lightning_dp"):
        make_accountant("lap2-paper")
    assert "NOT a valid upper bound" in caplog.text and "docs/design.md section 6.3" in caplog.text


# ------------------------------------------------------------------------------------ fast majorization sum


@pytest.mark.parametrize("n", [1, 16, 17, 100, 1000, 100_000])
@pytest.mark.parametrize("q", [0.01, 1.0])
def test_fast_paper_sum_is_tight_upper_bound(n: int, q: float) -> None:
    b = 0.7

    def log_moment(x: np.ndarray, eta: np.ndarray) -> np.ndarray:
        return laplace_log_moment(x / b, eta)

    orders = np.array([1, 3, 16, 64]) if n <= 1000 else np.array([2, 32])
    direct = paper_log_moments_direct(1.3, n, orders, q, log_moment)
    fast = paper_log_moments(1.3, n, orders, q, log_moment)
    assert np.all(fast >= direct * (1 - 1e-13))
    np.testing.assert_allclose(fast, direct, rtol=1e-4)


# ------------------------------------------------------------------------------------------------- CLT limit


def test_clt_against_sampled_gaussian_pld() -> None:
    """b = sigma C at n = 1e8: the Laplace sum is ~Gaussian, so the sound epsilon must not fall below ~PLD."""
    sigma, q, steps, delta = 1.0, 0.01, 1000, 1e-5
    gauss = epsilon_for(PoissonSampledEvent(q, GaussianEvent(sigma)), steps, delta, "pld")
    lap = epsilon_for(PoissonSampledEvent(q, Lap2Event(sigma, 1.0, 10**8)), steps, delta, "lap2")
    assert 0.97 * gauss <= lap <= 1.5 * gauss


def test_sound_never_above_large_n_limit_by_much() -> None:
    """The add-direction base moment F(C/sqrt n)^n is below the Gaussian exp(eta(eta-1)/(2 sigma^2))."""
    eta = np.arange(2, 3000, dtype=np.float64)
    for n in [1, 10, 10**4, 10**9]:
        lap = n * laplace_log_moment(1.0 / np.sqrt(n), eta)
        assert np.all(lap <= eta * (eta - 1) / 2 * (1 + 1e-12))


# ------------------------------------------------------------------------------------------------ validation


@pytest.mark.parametrize("name", ["lap2", "lap2-paper"])
@pytest.mark.parametrize(
    ("event", "match"),
    [
        (Lap2Event(0.0, 1.0, 10), "noise_scale"),
        (Lap2Event(1.0, -1.0, 10), "max_grad_norm"),
        (Lap2Event(1.0, 1.0, 0), "num_params"),
    ],
)
def test_bad_events(name: str, event: Lap2Event, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        epsilon_for(PoissonSampledEvent(0.01, event), 10, 1e-5, name)


def test_unsupported_event_and_q_out_of_range() -> None:
    with pytest.raises(ValueError, match="does not support"):
        make_accountant("lap2").compose(GaussianEvent(1.0))
    with pytest.raises(ValueError, match="does not support"):
        make_accountant("lap2").compose(PoissonSampledEvent(1.5, Lap2Event(1.0, 1.0, 3)))


def test_state_dict_roundtrip_and_speed_cache() -> None:
    acc = make_accountant("lap2").compose(PoissonSampledEvent(0.01, Lap2Event(1.0, 1.0, 10**8)), 500)
    clone = make_accountant("lap2")
    clone.load_state_dict(acc.state_dict())
    assert clone.get_epsilon(1e-5) == acc.get_epsilon(1e-5)


def test_combinations_do_not_crash() -> None:
    for name, q, n in itertools.product(["lap2", "lap2-paper"], [0.0, 0.5, 1.0], [1, 7]):
        eps = epsilon_for(PoissonSampledEvent(q, Lap2Event(2.0, 1.0, n)), 3, 1e-5, name)
        assert eps >= 0.0 and (eps == 0.0) == (q == 0.0)
