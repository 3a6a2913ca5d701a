"""Noise added piece by piece on the CPU (mechanisms/sampling.py:add_in_pieces): the same bits as one draw for the
Gaussian, every coordinate covered once, and the optimizer using it only for mechanisms that allow it."""

from __future__ import annotations

import pytest
import torch

from lightning_dp.mechanisms import make_mechanism, sampling
from lightning_dp.mechanisms.base import MECHANISMS
from lightning_dp.optim import DPOptimizer, DPRandomness

SIZES = [1, 15, 16, 17, 47, 48, 49, 63, 64, 65, 79, 80, 81, 96, 1000]


@pytest.fixture
def small_pieces(monkeypatch):
    """Pieces of 32 elements, so that the sizes above cross several pieces and every tail case."""
    monkeypatch.setattr(sampling, "PIECE", 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("size", SIZES)
def test_gaussian_pieces_are_the_bits_of_one_draw(small_pieces, size, dtype):
    start = torch.linspace(-1, 1, size, dtype=dtype).reshape(size, 1)
    whole = start.clone()
    whole.add_(sampling.sample_gaussian(whole, 0.7, torch.Generator().manual_seed(5)))
    pieces = start.clone()
    generator = torch.Generator().manual_seed(5)
    sampling.add_in_pieces(pieces, lambda piece: sampling.sample_gaussian(piece, 0.7, generator))
    assert torch.equal(pieces, whole)


@pytest.mark.parametrize("size", SIZES)
def test_pieces_cover_every_coordinate_once_at_least_16_each(small_pieces, size):
    seen: list[int] = []

    def draw(piece: torch.Tensor) -> torch.Tensor:
        seen.append(piece.numel())
        return torch.ones_like(piece)

    grad = torch.zeros(size)
    sampling.add_in_pieces(grad, draw)
    assert torch.equal(grad, torch.ones(size))
    assert sum(seen) == size
    assert all(n == 32 for n in seen[:-1])
    assert len(seen) == 1 or 16 <= seen[-1] < 32 + 16


def test_only_the_gaussian_is_piecewise():
    """PLRV-O draws one scale per call and so must noise a tensor in one call; the others keep their draws' bits."""
    assert {name for name, cls in MECHANISMS.items() if cls.piecewise} == {"gaussian"}


def _privatised(
    noise: str, size: int, steps: int = 1, expected_batch_size: float = 1.0, **params: float
) -> list[torch.Tensor]:
    """The privatised gradient of each of ``steps`` steps on a zero clipped sum (the first step reads the finite
    check and divides by a number, the later ones defer it and divide by a 0-dim float64 tensor)."""
    param = torch.nn.Parameter(torch.zeros(size))
    optimizer = DPOptimizer(
        torch.optim.SGD([param], lr=1.0),
        mechanism=make_mechanism(noise, max_grad_norm=1.0, **params),
        expected_batch_size=expected_batch_size,
        randomness=DPRandomness(7),
    )
    grads = []
    for _ in range(steps):
        param.grad = torch.zeros(size)
        optimizer.privatise()
        grads.append(param.grad)
    return grads


@pytest.mark.parametrize(
    ("noise", "params"), [("gaussian", {"noise_multiplier": 1.3}), ("laplace", {"noise_scale": 2.0})]
)
def test_the_optimizer_noise_does_not_depend_on_the_piece_size(monkeypatch, noise, params):
    """Pieces of 32 against one piece: the same bits (the Gaussian is drawn in pieces, the Laplace is not)."""
    whole = _privatised(noise, 1000, **params)[0]
    monkeypatch.setattr(sampling, "PIECE", 32)
    assert torch.equal(_privatised(noise, 1000, **params)[0], whole)


@pytest.mark.parametrize("piece", [32, sampling.PIECE])
def test_the_optimizer_divides_each_noised_gradient_once(monkeypatch, piece):
    """With ``q N = 3.7``, the reading step (a number) and the deferred ones (a 0-dim float64 tensor) give the noise of
    ``q N = 1`` divided once by 3.7, in pieces or not."""
    monkeypatch.setattr(sampling, "PIECE", piece)
    undivided = _privatised("gaussian", 1000, steps=3, noise_multiplier=1.3)
    divided = _privatised("gaussian", 1000, steps=3, expected_batch_size=3.7, noise_multiplier=1.3)
    for noise, grad in zip(undivided, divided, strict=True):
        assert torch.equal(grad, noise / 3.7)


def test_the_optimizer_draws_a_gaussian_in_pieces(monkeypatch):
    monkeypatch.setattr(sampling, "PIECE", 32)
    calls: list[int] = []
    original = sampling.sample_gaussian

    def counting(like: torch.Tensor, std: float, generator: torch.Generator) -> torch.Tensor:
        calls.append(like.numel())
        return original(like, std, generator)

    monkeypatch.setattr(sampling, "sample_gaussian", counting)
    _privatised("gaussian", 100, noise_multiplier=1.0)
    assert calls == [32, 32, 36]


def test_a_subclass_of_the_gaussian_is_not_piecewise_unless_it_says_so():
    """A subclass's ``sample`` may share a draw within a call (a random scale): it opts in itself."""
    from lightning_dp.mechanisms.gaussian import GaussianMechanism

    class ScaledGaussian(GaussianMechanism):
        pass

    class StillPiecewise(GaussianMechanism):
        piecewise = True

    assert GaussianMechanism.piecewise and not ScaledGaussian.piecewise and StillPiecewise.piecewise
