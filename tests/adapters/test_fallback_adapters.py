"""The exact fallback through both adapters under every engine: a GPT-2 whose final norm is a module of its own
parameters (no family) trains through DPTrainer, and the fallback's modules are named at attach."""

from __future__ import annotations

import logging

import pytest
import torch
from hf_helpers import make_trainer, tiny_gpt2
from torch import nn

from lightning_dp.clipping import ENGINES
from lightning_dp.hf import PrivacyArguments


class ScaledTanhNorm(nn.Module):
    """``tanh(x) * weight + bias`` with its own parameters: no layer family matches it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * self.weight + self.bias


@pytest.mark.parametrize("clipping", ENGINES)
def test_a_module_of_its_own_parameters_trains_through_dp_trainer(clipping: str, tmp_path, caplog) -> None:
    model = tiny_gpt2()
    model.transformer.ln_f = ScaledTanhNorm(model.config.n_embd)
    before = model.transformer.ln_f.weight.detach().clone()
    privacy = PrivacyArguments(noise_multiplier=1.0, clipping=clipping, dp_seed=0)
    with caplog.at_level(logging.INFO, logger="lightning_dp"):
        trainer = make_trainer(model, tmp_path, privacy=privacy, args={"max_steps": 2})
        trainer.train()
    assert trainer.privacy_engine.steps == 2 and trainer.privacy_engine.epsilon() > 0
    assert not torch.equal(model.transformer.ln_f.weight, before)
    assert any("'transformer.ln_f' (ScaledTanhNorm" in r.getMessage() for r in caplog.records)
