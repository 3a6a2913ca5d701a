"""Randomized norm engines ``hutch``/``hutchpp`` (DP-SGD-RC seed, Algorithm 2): unbiasedness against the torch.func
oracle, exact clipped sums given the estimated norms, DP-generator-only randomness, and the variance ratio of
Hutch++ against Hutch on a real layer (seed Figure 11a)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from clipping_helpers import IDS, TiedLM, oracle_grads, oracle_norms, rand, randomise, sin_loss
from sklearn.datasets import load_digits
from torch import nn

from lightning_dp.clipping import PerSampleClipper
from lightning_dp.optim import DPRandomness

RANDOMIZED = ("hutch", "hutchpp")


def _clipper(model: nn.Module, clipping: str, k: int, seed: int = 0) -> PerSampleClipper:
    randomness = DPRandomness(seed)
    return PerSampleClipper(
        model,
        clipping=clipping,
        max_grad_norm=1.0,
        projection_dim=k,
        generator_for=randomness.projection_generator,
    )


class SeqModel(nn.Module):
    """Tied embedding/head, a wide linear on sequences, a convolution and a LayerNorm (exact part)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TiedLM(vocab=7, dim=4, seq=6)
        self.conv = nn.Conv1d(7, 5, 3, padding=1)
        self.norm = nn.LayerNorm(6)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(self.lm(ids).transpose(1, 2)))


@pytest.mark.parametrize("clipping", RANDOMIZED)
def test_estimates_are_unbiased(clipping: str) -> None:
    """Mean of 200 independent squared-norm estimates within 4 standard errors of the exact squared norms."""
    model = randomise(SeqModel())
    exact = oracle_norms(oracle_grads(model, (IDS,))).square()
    clipper = _clipper(model, clipping, k=3)
    draws = torch.stack([clipper.per_sample_norms(sin_loss(model, (IDS,))).square() for _ in range(200)])
    mean, stderr = draws.mean(0), draws.std(0) / 200**0.5
    assert torch.all((mean - exact).abs() < 4 * stderr + 1e-12), (mean, exact, stderr)
    assert torch.all(draws.std(0) > 0), "the estimates must be random"


@pytest.mark.parametrize("clipping", RANDOMIZED)
def test_clipped_sum_uses_estimated_norms(clipping: str) -> None:
    """Same seed, same draws: p.grad equals sum_i min(1, C / n_i) grad_i with n_i the returned estimate."""
    model = randomise(SeqModel())
    grads = oracle_grads(model, (IDS,))
    norms = _clipper(model, clipping, k=2, seed=5).per_sample_norms(sin_loss(model, (IDS,)))
    clipper = _clipper(model, clipping, k=2, seed=5)
    returned = clipper.backward(sin_loss(model, (IDS,)))
    torch.testing.assert_close(returned, norms)
    factors = (1.0 / (norms + 1e-6)).clamp(max=1.0)
    named = dict(model.named_parameters())
    for name, per_sample in grads.items():
        torch.testing.assert_close(named[name].grad, torch.einsum("b,b...->...", factors, per_sample), msg=name)


@pytest.mark.parametrize("clipping", RANDOMIZED)
def test_randomness_comes_only_from_the_dp_generator(clipping: str) -> None:
    model = randomise(SeqModel())
    first = _clipper(model, clipping, k=2, seed=1).per_sample_norms(sin_loss(model, (IDS,)))
    torch.manual_seed(123)
    again = _clipper(model, clipping, k=2, seed=1).per_sample_norms(sin_loss(model, (IDS,)))
    other = _clipper(model, clipping, k=2, seed=2).per_sample_norms(sin_loss(model, (IDS,)))
    torch.testing.assert_close(first, again, rtol=0, atol=0)
    assert not torch.equal(first, other)


def test_projection_larger_than_rank_is_exact_for_hutchpp() -> None:
    """Hutch++ with k at least the gradient's rank captures it in the head: the estimate is exact."""
    model = randomise(nn.Linear(5, 40))
    x = rand(4, 3, 5)  # per-sample gradient of rank <= 3
    exact = oracle_norms(oracle_grads(model, (x,)))
    norms = _clipper(model, "hutchpp", k=4).per_sample_norms(sin_loss(model, (x,)))
    torch.testing.assert_close(norms, exact, rtol=1e-8, atol=0)


def test_randomized_engines_need_a_generator() -> None:
    with pytest.raises(ValueError, match="generator_for"):
        PerSampleClipper(nn.Linear(3, 3), clipping="hutch", max_grad_norm=1.0)
    with pytest.raises(ValueError, match="projection_dim applies"):
        PerSampleClipper(nn.Linear(3, 3), clipping="ghost", max_grad_norm=1.0, projection_dim=4)
    with pytest.raises(ValueError, match="positive integer"):
        _clipper(nn.Linear(3, 3), "hutch", k=0)


def _digits_conv_layer() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A conv layer of a small CNN on 64 real digit images, after 30 steps of plain training (a real layer)."""
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images[:64], dtype=torch.float64).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels[:64])
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.Tanh(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.Tanh(),
        nn.Flatten(),
        nn.Linear(32 * 64, 10),
    ).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(30):
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    for p in model.parameters():
        p.requires_grad_(False)
    model[2].weight.requires_grad_(True)
    return model, x, y


def test_hutchpp_error_an_order_of_magnitude_below_hutch() -> None:
    """Relative mean squared error of the squared-norm estimates on a real conv layer (seed Figure 11a)."""
    model, x, y = _digits_conv_layer()

    def loss(forward, inputs):  # inputs = (images, labels)
        return F.cross_entropy(forward(inputs[0]), inputs[1], reduction="none")

    exact = oracle_norms(oracle_grads(model, (x, y), loss_fn=loss)).square()
    errors = {}
    for clipping in RANDOMIZED:
        clipper = _clipper(model, clipping, k=16, seed=3)
        draws = torch.stack([clipper.per_sample_norms(loss(model, (x, y))).square() for _ in range(20)])
        errors[clipping] = ((draws - exact) / exact).square().mean().item()
    assert 0 < errors["hutch"] < 1.5 * 2 / 16, errors  # Hutchinson's relative variance is at most 2/k
    assert errors["hutchpp"] < errors["hutch"] / 10, errors


def test_norm_dim_is_the_largest_smaller_side() -> None:
    from lightning_dp.clipping.engines.hutch import norm_dim

    model = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 32), nn.LayerNorm(32), nn.Conv1d(32, 12, 3))
    assert norm_dim(list(model.parameters())) == 12  # conv weight [12, 32 * 3]; embedding 8, linear 8, vectors 1
    assert norm_dim([nn.Parameter(torch.zeros(5))]) == 1


def test_projection_and_noise_streams_differ_and_global_rng_is_untouched() -> None:
    randomness = DPRandomness(0)
    model = randomise(SeqModel())
    state = torch.get_rng_state()
    projection = torch.randn(1000, generator=randomness.projection_generator("cpu"))
    noise = torch.randn(1000, generator=randomness.noise_generator("cpu"))
    assert abs(float((projection * noise).mean())) < 0.15  # independent streams, not one stream twice
    _clipper(model, "hutch", k=2).per_sample_norms(sin_loss(model, (IDS,)))
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("clipping", RANDOMIZED)
def test_cuda_randomized_engines(clipping: str) -> None:
    model = randomise(SeqModel()).cuda()
    exact = oracle_norms(oracle_grads(model, (IDS.cuda(),))).square()
    clipper = _clipper(model, clipping, k=3)
    draws = torch.stack([clipper.per_sample_norms(sin_loss(model, (IDS.cuda(),))).square() for _ in range(200)])
    assert torch.all((draws.mean(0) - exact).abs() < 4 * draws.std(0) / 200**0.5 + 1e-12)
