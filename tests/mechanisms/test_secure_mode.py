"""secure_mode: OS-CSPRNG seeds for every draw, no user seed, hardened samplers with the same law."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import TinyRegressor, make_trainer
from scipy import stats

from lightning_dp import DPStrategy, PrivacyEngine
from lightning_dp.hf import PrivacyArguments
from lightning_dp.mechanisms import make_mechanism
from lightning_dp.mechanisms.secure import secure_gaussian, secure_laplace, secure_sample
from lightning_dp.optim import DPOptimizer, DPRandomness

N = 200_000


@pytest.mark.parametrize(
    "build",
    [
        lambda: PrivacyEngine(max_grad_norm=1.0, noise_multiplier=1.0, seed=3, secure_mode=True),
        lambda: DPStrategy(noise_multiplier=1.0, seed=3, secure_mode=True),
        lambda: PrivacyArguments(noise_multiplier=1.0, dp_seed=3, secure_mode=True),
        lambda: DPRandomness(3, secure=True),
    ],
)
def test_a_user_seed_is_rejected(build):
    with pytest.raises(ValueError, match="seed"):
        build()


def test_multi_process_sharing_is_rejected():
    with pytest.raises(ValueError, match="single-process"):
        DPRandomness(secure=True).share(5, rank=1)


def test_every_request_reseeds_from_the_os():
    randomness = DPRandomness(secure=True)
    a = torch.rand(8, generator=randomness.noise_generator("cpu"))
    b = torch.rand(8, generator=randomness.noise_generator("cpu"))
    assert not torch.equal(a, b)


def test_two_secure_runs_differ():
    runs = []
    for _ in range(2):
        torch.manual_seed(0)  # same data and initial weights: only the DP randomness can differ
        module = TinyRegressor()
        make_trainer(DPStrategy(noise_multiplier=1.0, secure_mode=True), max_steps=2).fit(module)
        runs.append(torch.cat([p.detach().flatten() for p in module.parameters()]))
    assert not torch.equal(*runs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_secure_gaussian_statistics(dtype):
    g = torch.Generator().manual_seed(0)
    z = secure_gaussian(torch.empty(N, dtype=dtype), 2.5, g).double()
    assert z.dtype == torch.float64 and abs(z.mean()) < 5 * 2.5 / math.sqrt(N)
    assert z.std() == pytest.approx(2.5, rel=0.01)
    if dtype != torch.bfloat16:  # bf16 rounding alone fails a KS test at this sample size
        assert stats.kstest(z.numpy() / 2.5, "norm").pvalue > 1e-3


@pytest.mark.parametrize("scale", [0.3, 2.0])
def test_secure_laplace_statistics(scale):
    g = torch.Generator().manual_seed(1)
    z = secure_laplace(torch.empty(N), scale, g).double()
    assert abs(z.mean()) < 5 * scale * math.sqrt(2 / N)
    assert z.abs().mean() == pytest.approx(scale, rel=0.01)  # E|z| = b
    assert z.std() == pytest.approx(math.sqrt(2) * scale, rel=0.015)  # Var z = 2 b^2
    assert stats.kstest(z.numpy(), "laplace", args=(0, scale)).pvalue > 1e-3


@pytest.mark.parametrize(
    ("name", "params", "expected_std"),
    [
        ("gaussian", {"noise_multiplier": 0.7}, 0.7 * 2.0),
        ("laplace", {"noise_scale": 1.5}, math.sqrt(2) * 1.5),
        ("lap2", {"noise_scale": 0.5}, math.sqrt(2) * 0.5),
        ("laplace-advanced", {"noise_scale": 0.5}, math.sqrt(2) * 0.5),
    ],
)
def test_secure_sample_has_the_mechanism_law(name, params, expected_std):
    mechanism = make_mechanism(name, max_grad_norm=2.0, **params)
    z = secure_sample(mechanism, torch.empty(N), torch.Generator().manual_seed(2)).double()
    plain = mechanism.sample(torch.empty(N), torch.Generator().manual_seed(2)).double()
    assert z.std() == pytest.approx(expected_std, rel=0.015)
    assert stats.ks_2samp(z.numpy(), plain.numpy()).pvalue > 1e-3


def test_secure_plrv_matches_the_plain_sampler():
    mechanism = make_mechanism("plrv", gamma_shape=20.0, gamma_scale=0.1, max_grad_norm=1.0)
    z = secure_sample(mechanism, torch.empty(N), torch.Generator().manual_seed(3)).double()
    plain = mechanism.sample(torch.empty(N), torch.Generator().manual_seed(4)).double()
    assert z.abs().mean() == pytest.approx(mechanism.expected_abs_noise(), rel=0.02)
    assert stats.ks_2samp(z.numpy(), plain.numpy()).pvalue > 1e-3


def test_optimizer_noise_in_secure_mode_has_the_right_scale():
    param = torch.nn.Parameter(torch.zeros(N))
    mechanism = make_mechanism("gaussian", noise_multiplier=1.3, max_grad_norm=1.0)
    optimizer = DPOptimizer(
        torch.optim.SGD([param], lr=1.0),
        mechanism=mechanism,
        expected_batch_size=1.0,
        randomness=DPRandomness(secure=True),
        secure_mode=True,
    )
    param.grad = torch.zeros(N)
    optimizer.privatise()
    assert abs(float(param.grad.mean())) < 5 * 1.3 / math.sqrt(N)
    assert float(param.grad.std()) == pytest.approx(1.3, rel=0.01)
