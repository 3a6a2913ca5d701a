"""Streaming ``C^{-1} Z``: equal to the dense product for the same ``Z``, the prefix sums' noise equal to
``A C^{-1} Z``, b = 1 bit-identical to plain Gaussian noise, the empirical covariance equal to ``C^{-1} C^{-T}``,
and a checkpoint mid-band resuming bit-identically."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from lightning_dp.correlated_noise.strategies import BandedToeplitz, BufferedToeplitz
from lightning_dp.correlated_noise.streaming import BandedNoise, BLTNoise, noise_stream, standard_normal
from lightning_dp.correlated_noise.workloads import Workload

STRATEGIES = [
    BandedToeplitz((1.0, 0.6, 0.3, -0.1)),
    BufferedToeplitz((0.95, 0.6, 0.1), (0.25, 0.2, 0.1)),
]
IDS = ["banded", "blt"]


def run(stream, z: torch.Tensor) -> torch.Tensor:
    """Stream the rows ``z[t]`` (each a list of two tensors: a [3] and a [2, 2] parameter); stacked ``[n, 7]``."""
    out = []
    for zt in z:
        x = stream.correlate([zt[:3], zt[3:].reshape(2, 2)])
        out.append(torch.cat([x[0], x[1].reshape(-1)]))
    return torch.stack(out)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=IDS)
def test_stream_equals_dense_inverse_and_prefix_sums(strategy):
    n = 12
    z = torch.randn(n, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x = run(noise_stream(strategy), z).numpy()
    dense = strategy.inverse_dense(n) @ z.numpy()
    assert np.allclose(x, dense, rtol=0, atol=1e-13)
    for workload in (Workload(n), Workload(n, 0.9)):
        # the noise in every iterate of SGD (with momentum) is A C^{-1} Z
        assert np.allclose(workload.matrix() @ x, workload.matrix() @ dense, rtol=0, atol=1e-12)
    assert np.allclose(strategy.dense(n) @ x, z.numpy(), rtol=0, atol=1e-12)


def test_band_one_is_plain_gaussian_noise_bit_for_bit():
    likes = [torch.zeros(5, 3), torch.zeros(4)]
    stream = noise_stream(BandedToeplitz.identity())
    ours, plain = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for _ in range(6):
        noise = stream.step(likes, ours)
        expected = [torch.empty(like.shape).normal_(generator=plain) for like in likes]
        assert all(torch.equal(a, b) for a, b in zip(noise, expected, strict=True))
    assert stream.num_buffers == 0 and stream.state_dict()["state"] == []


def test_band_one_passes_the_gaussian_mechanisms_draw_through():
    """The wiring draws the scaled noise with the mechanism's sampler and correlates it: b = 1 returns it as is."""
    from lightning_dp.mechanisms.sampling import sample_gaussian

    for like in (torch.zeros(7), torch.zeros(7, dtype=torch.bfloat16)):
        stream = noise_stream(BandedToeplitz.identity())
        ours, plain = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        for _ in range(4):
            noise = stream.correlate([sample_gaussian(like, 1.7, ours)])[0]
            expected = sample_gaussian(like, 1.7, plain)
            assert noise.dtype == like.dtype and torch.equal(noise, expected)


@pytest.mark.parametrize("strategy", STRATEGIES, ids=IDS)
def test_empirical_covariance(strategy):
    """Draws vectorised as coordinates: 40000 draws x 2 coordinates, n = 7 steps. Each entry of the empirical
    covariance is within 5 standard errors of (C^{-1} C^{-T})_{st}, the standard error of a sample covariance of
    Gaussians being sqrt((S_ss S_tt + S_st^2) / N)."""
    n, draws = 7, 40_000
    generator = torch.Generator().manual_seed(1234)
    stream = noise_stream(strategy)
    x = torch.stack([stream.step([torch.zeros(draws, 2, dtype=torch.float64)], generator)[0] for _ in range(n)])
    x = x.permute(2, 1, 0).numpy()  # [coordinate, draw, step]
    inv = strategy.inverse_dense(n)
    expected = inv @ inv.T
    se = np.sqrt((np.outer(np.diag(expected), np.diag(expected)) + expected**2) / draws)
    for coordinate in x:
        empirical = coordinate.T @ coordinate / draws
        assert np.all(np.abs(empirical - expected) < 5 * se)
    cross = x[0].T @ x[1] / draws  # independent coordinates
    assert np.all(np.abs(cross) < 5 * np.sqrt(np.outer(np.diag(expected), np.diag(expected)) / draws))


@pytest.mark.parametrize("strategy", STRATEGIES, ids=IDS)
@pytest.mark.parametrize("stop", [1, 2, 5])
def test_resume_mid_band_is_bit_identical(strategy, stop):
    n = 9
    likes = [torch.zeros(4, 3), torch.zeros(5, dtype=torch.float64)]
    generator = torch.Generator().manual_seed(99)
    whole = noise_stream(strategy)
    uninterrupted = [whole.step(likes, generator) for _ in range(n)]

    generator = torch.Generator().manual_seed(99)
    first = noise_stream(strategy)
    resumed = [first.step(likes, generator) for _ in range(stop)]
    buffer = io.BytesIO()
    torch.save({"noise": first.state_dict(), "generator": generator.get_state()}, buffer)
    del first
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    second = noise_stream(strategy)
    second.load_state_dict(checkpoint["noise"])
    generator = torch.Generator()
    generator.set_state(checkpoint["generator"])
    resumed += [second.step(likes, generator) for _ in range(n - stop)]
    assert second.step_index == n
    for a, b in zip(uninterrupted, resumed, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_memory_is_b_minus_one_or_d_tensors():
    likes = [torch.zeros(3), torch.zeros(2, 2)]
    generator = torch.Generator().manual_seed(0)
    banded, blt = BandedNoise(BandedToeplitz((1.0, 0.5, 0.2, 0.1, 0.05))), BLTNoise(STRATEGIES[1])
    for _ in range(10):
        banded.step(likes, generator)
        blt.step(likes, generator)
    assert len(banded.state_dict()["state"]) == banded.num_buffers == 4
    assert len(blt.state_dict()["state"]) == blt.num_buffers == 3


@pytest.mark.parametrize("strategy", STRATEGIES, ids=IDS)
def test_low_precision_tensors_work_in_float32(strategy):
    like = torch.zeros(6, dtype=torch.bfloat16)
    stream = noise_stream(strategy)
    generator = torch.Generator().manual_seed(0)
    noise = [stream.step([like], generator)[0] for _ in range(3)]
    assert all(x.dtype == torch.bfloat16 for x in noise)
    assert stream.state_dict()["state"][0][0].dtype == torch.float32
    assert standard_normal([like], generator)[0].dtype == torch.float32
    # 16-bit Z passed to correlate (the Gaussian mechanism's own draw, cast to the gradient's dtype) is correlated in
    # float32 too: the same as correlating its float32 copy, cast back
    z = [torch.randn(5, 6, generator=generator).to(torch.bfloat16) for _ in range(5)]
    low, high = noise_stream(strategy), noise_stream(strategy)
    for zt in z:
        x = low.correlate([zt])[0]
        assert x.dtype == torch.bfloat16
        assert torch.equal(x, high.correlate([zt.float()])[0].to(torch.bfloat16))
    assert low.state_dict()["state"][0][0].dtype == torch.float32


def test_mismatches_fail_early():
    stream = noise_stream(STRATEGIES[0])
    stream.correlate([torch.zeros(3)])
    with pytest.raises(ValueError, match="changed shape"):
        stream.correlate([torch.zeros(4)])
    other = noise_stream(BandedToeplitz((1.0, 0.5)))
    with pytest.raises(ValueError, match="is not this run's"):
        other.load_state_dict(stream.state_dict())
    with pytest.raises(ValueError, match="is not this run's"):
        noise_stream(STRATEGIES[1]).load_state_dict(stream.state_dict())
    with pytest.raises(TypeError, match="BandedToeplitz or BufferedToeplitz"):
        noise_stream("banded")  # type: ignore[arg-type]
    truncated = {**stream.state_dict(), "step": 5}  # one step taken, so one vector; step 5 needs three
    with pytest.raises(ValueError, match="holds 1 vectors after step 5; this strategy keeps 3") as info:
        noise_stream(STRATEGIES[0]).load_state_dict(truncated)
    assert "\n" not in str(info.value)
