"""Noise mechanisms: distributions, determinism, RNG isolation, dtype/device, events and validation."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from lightning_dp.accounting.events import Lap2Event, LaplaceEvent, PlrvEvent, PoissonSampledEvent
from lightning_dp.mechanisms import MECHANISMS, make_mechanism
from lightning_dp.mechanisms.sampling import sample_gamma, sample_laplace

N = 200_000
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

MECHS = {
    "gaussian": dict(noise_multiplier=1.3, max_grad_norm=0.7),
    "laplace": dict(noise_scale=2.5, max_grad_norm=1.0),
    "laplace-advanced": dict(noise_scale=1.5, max_grad_norm=2.0),
    "lap2": dict(noise_scale=0.8, max_grad_norm=1.0),
    "plrv": dict(gamma_shape=6.0, gamma_scale=0.4, max_grad_norm=3.0),
}


def gen(seed: int = 0, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def test_registry_has_all_mechanisms() -> None:
    assert {"gaussian", "laplace", "laplace-advanced", "lap2", "plrv"} <= set(MECHANISMS)
    assert MECHANISMS["laplace"].clip_norm == 1
    assert all(MECHANISMS[n].clip_norm == 2 for n in ("gaussian", "laplace-advanced", "lap2", "plrv"))
    assert MECHANISMS["laplace"].default_accountant == "basic"
    assert MECHANISMS["laplace-advanced"].default_accountant == "lap2"
    assert MECHANISMS["lap2"].default_accountant == "lap2"
    assert MECHANISMS["plrv"].default_accountant == "plrv"


@pytest.mark.parametrize("shape", [0.3, 1.0, 2.5, 141.0, 5000.0])
def test_gamma_sampler_matches_gamma_distribution(shape: float) -> None:
    scale = 0.37
    x = sample_gamma(shape, scale, (20_000,), gen(1), dtype=torch.float64)
    assert x.dtype == torch.float64 and bool((x > 0).all())
    assert stats.kstest(x.numpy(), "gamma", args=(shape, 0, scale)).pvalue > 1e-3
    assert x.mean().item() == pytest.approx(shape * scale, rel=0.03)


def test_gamma_sampler_is_deterministic_and_leaves_global_rng_alone() -> None:
    state = torch.random.get_rng_state()
    a = sample_gamma(2.0, 1.0, (3, 4), gen(5))
    b = sample_gamma(2.0, 1.0, (3, 4), gen(5))
    assert a.shape == (3, 4) and torch.equal(a, b)
    assert torch.equal(state, torch.random.get_rng_state())


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_gamma_sampler_rejects_bad_parameters(bad: float) -> None:
    with pytest.raises(ValueError, match="gamma shape"):
        sample_gamma(bad, 1.0, (2,), gen())
    with pytest.raises(ValueError, match="gamma scale"):
        sample_gamma(1.0, bad, (2,), gen())


def test_laplace_sampler_ks() -> None:
    z = sample_laplace(torch.empty(50_000, dtype=torch.float64), 1.7, gen(3))
    assert stats.kstest(z.numpy(), "laplace", args=(0, 1.7)).pvalue > 1e-3


def test_laplace_mechanism_noise_distribution() -> None:
    mech = make_mechanism("laplace", **MECHS["laplace"])
    z = mech.sample(torch.empty(N, dtype=torch.float64), gen(11)).numpy()
    assert stats.kstest(z, "laplace", args=(0, 2.5)).pvalue > 1e-3
    assert abs(z.mean()) < 0.03
    assert z.std() == pytest.approx(math.sqrt(2) * 2.5, rel=0.02)
    assert abs(z).mean() == pytest.approx(mech.expected_abs_noise(), rel=0.02)


@pytest.mark.parametrize("name", ["lap2", "laplace-advanced"])
def test_l2_laplace_mechanisms_noise_distribution(name: str) -> None:
    mech = make_mechanism(name, **MECHS[name])
    b = MECHS[name]["noise_scale"]
    z = mech.sample(torch.empty(N, dtype=torch.float64), gen(12)).numpy()
    assert stats.kstest(z, "laplace", args=(0, b)).pvalue > 1e-3
    assert abs(z).mean() == pytest.approx(mech.expected_abs_noise(), rel=0.02) and mech.expected_abs_noise() == b
    assert z.std() == pytest.approx(math.sqrt(2) * b, rel=0.02)


def test_plrv_noise_distribution() -> None:
    """``|z|`` with ``u ~ Gamma(k, theta)``, ``z ~ Lap(1/u)`` has survival ``E exp(-t u) = (1 + t theta)^-k``: Lomax."""
    k, theta = MECHS["plrv"]["gamma_shape"], MECHS["plrv"]["gamma_scale"]
    mech = make_mechanism("plrv", **MECHS["plrv"])
    z = mech.sample(torch.empty(N, dtype=torch.float64), gen(13)).numpy()
    assert stats.kstest(abs(z), "lomax", args=(k, 0, 1 / theta)).pvalue > 1e-3
    assert abs(z).mean() == pytest.approx(mech.expected_abs_noise(), rel=0.03)
    assert mech.expected_abs_noise() == pytest.approx(1 / ((k - 1) * theta))
    assert z.std() == pytest.approx(math.sqrt(2 / ((k - 1) * (k - 2))) / theta, rel=0.05)  # Var = E[2/u^2]
    assert abs(z.mean()) < 0.05
    # noise is not scaled by C: C enters only the accountant
    wide = make_mechanism("plrv", gamma_shape=k, gamma_scale=theta, max_grad_norm=100.0)
    assert torch.equal(wide.sample(torch.empty(100), gen(1)), mech.sample(torch.empty(100), gen(1)))


def test_gaussian_expected_abs_noise() -> None:
    mech = make_mechanism("gaussian", **MECHS["gaussian"])
    z = mech.sample(torch.empty(N, dtype=torch.float64), gen(14)).numpy()
    assert abs(z).mean() == pytest.approx(mech.expected_abs_noise(), rel=0.02)


@pytest.mark.parametrize("name", sorted(MECHS))
def test_determinism_and_global_rng_untouched(name: str) -> None:
    mech = make_mechanism(name, **MECHS[name])
    like = torch.zeros(4, 5)
    state = torch.random.get_rng_state()
    a, b, c = mech.sample(like, gen(7)), mech.sample(like, gen(7)), mech.sample(like, gen(8))
    assert torch.equal(state, torch.random.get_rng_state())
    assert torch.equal(a, b) and not torch.equal(a, c)
    g = gen(9)
    assert not torch.equal(mech.sample(like, g), mech.sample(like, g))  # the generator advances


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(MECHS))
def test_dtype_device_and_shape_preserved(name: str, dtype: torch.dtype, device: str) -> None:
    mech = make_mechanism(name, **MECHS[name])
    like = torch.zeros(3, 7, dtype=dtype, device=device)
    z = mech.sample(like, gen(0, device))
    assert z.shape == like.shape and z.dtype == dtype and z.device == like.device
    assert bool(torch.isfinite(z).all()) and bool((z != 0).any())


def test_step_events() -> None:
    q, n = 0.01, 1234
    assert make_mechanism("laplace", **MECHS["laplace"]).step_event(q, n) == PoissonSampledEvent(
        q, LaplaceEvent(2.5, 1.0)
    )
    for name in ("lap2", "laplace-advanced"):
        p = MECHS[name]
        assert make_mechanism(name, **p).step_event(q, n) == PoissonSampledEvent(
            q, Lap2Event(p["noise_scale"], p["max_grad_norm"], n)
        )
    assert make_mechanism("plrv", **MECHS["plrv"]).step_event(q, n) == PoissonSampledEvent(
        q, PlrvEvent(6.0, 0.4, 3.0, n)
    )


@pytest.mark.parametrize(
    ("name", "params", "match"),
    [
        ("laplace", dict(noise_scale=0.0, max_grad_norm=1.0), "noise_scale"),
        ("laplace", dict(noise_scale=1.0, max_grad_norm=-1.0), "max_grad_norm"),
        ("lap2", dict(noise_scale=float("nan"), max_grad_norm=1.0), "noise_scale"),
        ("laplace-advanced", dict(noise_scale=-2.0, max_grad_norm=1.0), "calibrate"),
        ("plrv", dict(gamma_shape=1.0, gamma_scale=0.1, max_grad_norm=1.0), "c3"),
        ("plrv", dict(gamma_shape=3.0, gamma_scale=0.0, max_grad_norm=1.0), "gamma_scale"),
        ("plrv", dict(gamma_shape=3.0, gamma_scale=0.1, max_grad_norm=0.0), "max_grad_norm"),
    ],
)
def test_invalid_parameters_raise(name: str, params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_mechanism(name, **params)


def test_describe_lists_parameters() -> None:
    assert make_mechanism("plrv", **MECHS["plrv"]).describe() == MECHS["plrv"]
    assert make_mechanism("lap2", **MECHS["lap2"]).describe() == MECHS["lap2"]
    assert make_mechanism("laplace", **MECHS["laplace"]).describe() == MECHS["laplace"]


@pytest.mark.parametrize("name", sorted(MECHS))
def test_describe_round_trips_through_registry(name: str) -> None:
    """Checkpoints store ``{"name", **describe()}`` and rebuild with ``make_mechanism``."""
    mech = make_mechanism(name, **MECHS[name])
    again = make_mechanism(mech.name, **mech.describe())
    assert type(again) is type(mech) and again.describe() == mech.describe()


@pytest.mark.parametrize("name", sorted(MECHS))
@pytest.mark.parametrize("shape", [(), (0,), (2, 0, 3)])
def test_scalar_and_empty_shapes(name: str, shape: tuple[int, ...]) -> None:
    z = make_mechanism(name, **MECHS[name]).sample(torch.zeros(shape), gen(2))
    assert z.shape == torch.Size(shape)
