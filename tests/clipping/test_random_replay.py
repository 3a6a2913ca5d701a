"""Dropout and random draws inside modules the exact fallback reruns (clipping/layers/random_replay.py): the masks and
draws of the call are replayed in the rerun, so per-sample norms and clipped sums in train mode equal the per-example
gradients of the same forward (one example's loss at a time through the batch's graph, the oracle of a per-sample model
whatever its randomness); a mask shared by the batch is applied whole; in-place random fills are still refused."""

from __future__ import annotations

import pytest
import torch
from clipping_helpers import ENGINES, check_against_batch_graph, rand, randomise
from torch import nn

from lightning_dp.checks.attach_probe import probe_at_attach
from lightning_dp.clipping import PerSampleClipper, UnsupportedModuleError

B = 5


class DroppedScale(nn.Module):
    """``dropout(x * scale)``: a module of the fallback with an ``nn.Dropout`` child."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.drop = nn.Dropout(0.4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(x * self.scale)


class SharedTable(nn.Module):
    """Adds a position table of its own, dropped once for the whole batch (as DeBERTa drops its relative
    embeddings), then drops each example's rows functionally."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.zeros(3, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        table = nn.functional.dropout(self.table, 0.3, self.training)
        return nn.functional.dropout(torch.tanh(x + table), 0.2, self.training)


class DropPath(nn.Module):
    """A residual branch with a learned scale and stochastic depth as HF writes it (``torch.rand``, then ``floor_``)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = 0.6 + torch.rand((x.shape[0],) + (1,) * (x.ndim - 1), dtype=x.dtype, device=x.device)
        keep.floor_()
        return x + torch.tanh(x * self.scale).div(0.6) * keep


class ReadsTable(nn.Module):
    """Reads a child embedding's weight outside the child's forward, with dropout around: enclosed by the root."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 6)
        self.positions = nn.Embedding(3, 6)
        self.drop = nn.Dropout(0.3)
        self.out = nn.Linear(6, 2)
        self.example_input_array = torch.randn(3, 3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.inner(x)) + self.drop(self.positions.weight)
        return self.out(torch.tanh(h)).sum(1)


def _check(model: nn.Module, x: torch.Tensor, clipping: str, attach: bool = False) -> PerSampleClipper:
    def loss() -> torch.Tensor:
        torch.manual_seed(7)
        return torch.sin(model(x)).flatten(1).sum(1)

    return check_against_batch_graph(model, loss, clipping, (lambda c: probe_at_attach(model, c)) if attach else None)


@pytest.mark.parametrize("clipping", ENGINES)
def test_dropout_in_a_fallback_module_is_replayed_exactly(clipping: str) -> None:
    model = randomise(nn.Sequential(nn.Linear(4, 6), DroppedScale(6), nn.Linear(6, 2))).train()
    _check(model, rand(B, 4), clipping)


@pytest.mark.parametrize("clipping", ENGINES)
def test_a_mask_shared_by_the_batch_is_replayed_whole(clipping: str) -> None:
    model = randomise(nn.Sequential(nn.Linear(4, 6), SharedTable(6), nn.Linear(6, 2))).train()
    _check(model, rand(B, 3, 4), clipping)


@pytest.mark.parametrize("clipping", ["flat", "mixed"])
def test_stochastic_depth_is_replayed_exactly(clipping: str) -> None:
    model = randomise(nn.Sequential(nn.Linear(4, 6), DropPath(6), nn.Linear(6, 2))).train()
    _check(model, rand(8, 3, 4), clipping)


@pytest.mark.parametrize("clipping", ["flat", "ghost"])
def test_dropout_in_an_enclosing_module_is_replayed_exactly(clipping: str) -> None:
    model = randomise(ReadsTable()).train()
    model.example_input_array = rand(3, 3, 4)
    clipper = _check(model, rand(B, 3, 4), clipping, attach=True)
    assert clipper.enclosing == {"": ("positions",)}


def test_the_dropout_of_the_forward_is_dropout() -> None:
    """The recorded dropout keeps each entry with probability 1 - p and scales it by 1 / (1 - p)."""
    model = nn.Sequential(nn.Linear(1, 1, bias=False), DroppedScale(20_000)).train()
    nn.init.ones_(model[0].weight)
    PerSampleClipper(model, max_grad_norm=1.0)
    torch.manual_seed(0)
    out = model(torch.ones(2, 1, 1))
    kept = out != 0
    assert abs(kept.double().mean().item() - 0.6) < 0.01
    torch.testing.assert_close(out[kept], torch.full_like(out[kept], 1 / 0.6))


def test_eval_mode_draws_no_mask() -> None:
    model = nn.Sequential(nn.Linear(4, 6), DroppedScale(6)).eval()
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    model(torch.randn(3, 4))
    (call,) = [c.call for c in clipper._hooks.captures if c.call is not None]
    assert call.draws == []


class AlphaDropped(DroppedScale):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.alpha_dropout(x * self.scale, 0.3, self.training)


class UniformNoise(DroppedScale):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + torch.empty_like(x).uniform_()


@pytest.mark.parametrize("module", [AlphaDropped, UniformNoise])
def test_other_random_numbers_are_refused(module: type[nn.Module]) -> None:
    model = nn.Sequential(nn.Linear(4, 6), module(6)).train()
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    with pytest.raises(UnsupportedModuleError, match=rf"'1' \({module.__name__}\) cannot be rerun per sample.*random"):
        clipper.backward(model(torch.randn(3, 4)).sum(1))


class Gated(nn.Module):
    """Mixes the batch on a random branch: a draw replayed whole decides it for every example."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.rand(()) < 0.5:
            x = x.roll(1, 0)
        return x * self.scale


def test_a_call_with_a_draw_replayed_whole_is_compared_on_every_batch() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Gated()).double()
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    x = rand(4, 4)
    closed = next(s for s in range(100) if (torch.manual_seed(s), torch.rand(()))[1] >= 0.5)
    mixing = next(s for s in range(100) if (torch.manual_seed(s), torch.rand(()))[1] < 0.5)
    torch.manual_seed(closed)
    clipper.per_sample_norms(torch.sin(model(x)).sum(1))  # the gate closed: per-sample, but not confirmed
    torch.manual_seed(mixing)
    with pytest.raises(UnsupportedModuleError, match=r"'1' \(Gated\) is not per-sample"):
        clipper.per_sample_norms(torch.sin(model(x)).sum(1))


def test_draws_by_keyword_size_and_the_bernoulli_method_are_replayed() -> None:
    class Draws(DroppedScale):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            keep = torch.rand(size=(x.shape[0], 1)).to(x.dtype).bernoulli()
            return x * self.scale * keep

    model = randomise(nn.Sequential(nn.Linear(4, 6), Draws(6), nn.Linear(6, 2))).train()
    _check(model, rand(B, 4), "mixed")


def test_an_interrupted_forward_leaves_no_recorder_behind() -> None:
    class Interrupted(DroppedScale):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise KeyboardInterrupt

    model = nn.Sequential(nn.Linear(4, 6), Interrupted(6)).train()
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    with pytest.raises(KeyboardInterrupt):
        model(torch.randn(3, 4))
    clipper.detach()
    assert torch._C._len_torch_function_stack() == 0


def test_a_structured_output_keeps_its_dtypes() -> None:
    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * self.scale, (x * self.scale).bfloat16()

    model = nn.Sequential(nn.Linear(4, 4), Mixed())
    PerSampleClipper(model, max_grad_norm=1.0)
    assert [t.dtype for t in model(torch.randn(3, 4))] == [torch.float32, torch.bfloat16]
