"""The attach probe (checks/attach_probe.py): a model with example inputs of its own is refused at attach, not at its
first step, for what only a forward shows; the probe leaves the model's mode, buffers, RNG and .grad as they were."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dp.checks.attach_probe import probe_at_attach
from lightning_dp.clipping import PerSampleClipper, UnsupportedModuleError


class ReadsChildWeight(nn.Module):
    """Uses a child Linear's weight outside the child's forward and counts its calls in a buffer (so the enclosing
    module cannot be rerun); offers example inputs as Lightning does."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))
        self.example_input_array = torch.randn(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.nn.functional.dropout(x @ self.proj.weight.T, 0.1, self.training)


def test_a_parameter_read_outside_its_forward_is_refused_by_the_probe() -> None:
    model = ReadsChildWeight().eval()
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    state = torch.random.get_rng_state()
    refusal = r"'proj\.weight'.*outside its module's forward.*LoRA.*cannot serve it either"
    with pytest.raises(UnsupportedModuleError, match=refusal):
        probe_at_attach(model, clipper)
    assert not model.training and model.calls.item() == 0, "mode and buffers restored"
    assert torch.equal(torch.random.get_rng_state(), state), "the global RNG is restored"
    assert all(p.grad is None for p in model.parameters())


def test_a_supported_model_passes_and_its_first_batch_is_still_checked() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    model.example_input_array = torch.randn(3, 4)
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    assert probe_at_attach(model, clipper)
    assert clipper._checked_batches == 0 and clipper._hooks.record_outputs and not clipper._rows_verified
    assert all(p.grad is None for p in model.parameters())


def test_inputs_the_model_does_not_take_skip_the_probe() -> None:
    model = nn.Sequential(nn.Linear(4, 3))
    model.dummy_inputs = {"input_ids": torch.zeros(3, 5, dtype=torch.long)}  # HF's generic inputs: not for this model
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    assert not probe_at_attach(model, clipper)
    assert not clipper._hooks.captures
    assert not probe_at_attach(nn.Linear(2, 2), PerSampleClipper(nn.Linear(2, 2), max_grad_norm=1.0))


class _SeesAutocast(torch.autograd.Function):
    """Identity that notes whether CPU autocast is on in its forward and in its backward."""

    seen: list[tuple[str, bool]] = []

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        _SeesAutocast.seen.append(("forward", torch.is_autocast_enabled("cpu")))
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        _SeesAutocast.seen.append(("backward", torch.is_autocast_enabled("cpu")))
        return grad


class NotesAutocast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 3)
        self.example_input_array = torch.randn(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SeesAutocast.apply(self.proj(x))  # between the loss and the layer: the clip's backward runs it


def test_the_probe_forward_runs_in_the_given_context_and_its_clip_outside_it() -> None:
    model = NotesAutocast()
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    _SeesAutocast.seen.clear()
    assert probe_at_attach(model, clipper, lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    assert ("forward", True) in _SeesAutocast.seen and ("backward", True) not in _SeesAutocast.seen
    assert ("backward", False) in _SeesAutocast.seen and not torch.is_autocast_enabled("cpu")
