"""The batch-independence check hands the model float inputs it can treat as its own: it may set ``requires_grad``
on them (or on a view, as HF's wav2vec2-family feature encoders do in training) and change them in place, and the
check still sees mixing through them (docs/design.md section 9.4)."""

from __future__ import annotations

import pytest
import torch
from helpers import ClassifierWith, make_trainer
from torch import nn

import lightning_dp.checks.guard as guard_module
from lightning_dp.checks.independence import BatchMixingError, InputsRequireGrad, input_leaves
from lightning_dp.lightning import DPStrategy


def _own(x: torch.Tensor, how: str) -> torch.Tensor:
    if how == "assign":
        x.requires_grad = True
    elif how == "assign a view":  # HF's Wav2Vec2FeatureEncoder: input_values[:, None], then requires_grad = True
        view = x[:, None]
        view.requires_grad = True
        x = view[:, 0]
    elif how == "method":
        x.requires_grad_(True)
    elif how == "in place":
        x.mul_(2.0)
    return x


class OwnsItsInput(nn.Module):
    """Sets ``requires_grad`` on (or writes in place to) its float input before its first layer; with ``mix``, then
    centres it over the batch (mixing before any hooked layer: only the input leaf can see it)."""

    def __init__(self, how: str, mix: bool = False, d: int = 6) -> None:
        super().__init__()
        self.how, self.mix = how, mix
        self.lin = nn.Linear(d, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _own(x, self.how)
        return self.lin(x - x.mean(0) if self.mix else x)


HOW = ["assign", "assign a view", "method", "in place"]


def test_an_assignment_the_clones_refuse_is_a_no_op_under_the_mode() -> None:
    batch, leaves = input_leaves(torch.randn(4, 6), 4)
    with pytest.raises(RuntimeError, match="only change requires_grad flags of leaf variables"):
        batch.requires_grad = True  # what a model assigning it hit before (the check's clone is not a leaf)
    with InputsRequireGrad():
        batch.requires_grad = True
        batch[:, None].requires_grad = True
        plain = torch.randn(3)
        plain.requires_grad = True  # other tensors as without the mode
        assert plain.requires_grad and plain.is_leaf
        with pytest.raises(RuntimeError, match="leaf variables"):
            batch.requires_grad = False  # switching it off stays refused
    (grad,) = torch.autograd.grad(batch.sum(), leaves["input 0"])
    assert torch.equal(grad, torch.ones(4, 6))


@pytest.mark.parametrize("momentum", [False, True], ids=["plain", "momentum"])
@pytest.mark.parametrize("how", HOW)
def test_a_model_owning_its_input_trains_with_the_input_checked(how, momentum, monkeypatch) -> None:
    targets = []
    original = guard_module.check_batch_independence
    monkeypatch.setattr(
        guard_module, "check_batch_independence", lambda loss, t, *a: targets.append(list(t)) or original(loss, t, *a)
    )
    extra = dict(momentum_length=1) if momentum else {}
    trainer = make_trainer(DPStrategy(noise_multiplier=1.0, seed=0, **extra), max_steps=2)
    trainer.fit(ClassifierWith(OwnsItsInput(how)))
    assert trainer.global_step == 2
    assert targets and "input 0" in targets[0]


@pytest.mark.parametrize("how", HOW)
def test_mixing_through_an_owned_input_is_still_found(how) -> None:
    module = ClassifierWith(OwnsItsInput(how, mix=True))
    trainer = make_trainer(DPStrategy(noise_multiplier=1.0, seed=0), max_steps=2)
    with pytest.raises(BatchMixingError, match=r"example \d+'s input 0"):
        trainer.fit(module)
