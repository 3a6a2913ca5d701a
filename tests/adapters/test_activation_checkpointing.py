"""Both adapters under non-reentrant activation checkpointing train exactly as without it (the same noise, the same
Poisson batches, the same clipped sums), recomputing the checkpointed layers; reentrant checkpointing is refused when
the run is set up."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_dp import DPStrategy
from lightning_dp.hf import PrivacyArguments
from tests.helpers import TinyRegressor, make_trainer
from tests.hf_helpers import make_trainer as make_hf_trainer
from tests.hf_helpers import tiny_llama, trainable_snapshot


class CheckpointedRegressor(TinyRegressor):
    """TinyRegressor whose hidden layer runs under ``torch.utils.checkpoint`` (counting the Linear's calls)."""

    def __init__(self, checkpointed: bool, use_reentrant: bool = False) -> None:
        super().__init__(batch_size=16)
        self.checkpointed, self.use_reentrant, self.calls = checkpointed, use_reentrant, 0
        self.net[0].register_forward_hook(lambda *_: setattr(self, "calls", self.calls + 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        hidden = nn.Sequential(self.net[0], self.net[1])
        if self.checkpointed:
            h = checkpoint(hidden, x, use_reentrant=self.use_reentrant)
        else:
            h = hidden(x)
        return ((self.net[2](h) - y) ** 2).squeeze(-1)


def test_lightning_checkpointed_run_equals_the_plain_run() -> None:
    runs = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        module = CheckpointedRegressor(checkpointed)
        strategy = DPStrategy(noise_multiplier=0.5, max_grad_norm=0.5, clipping="mixed", seed=3)
        make_trainer(strategy, max_steps=3).fit(module)
        runs.append((trainable_snapshot(module), module.calls))
    (plain, plain_calls), (recomputed, recomputed_calls) = runs
    for name, value in plain.items():
        torch.testing.assert_close(recomputed[name], value, msg=name)
    assert recomputed_calls > plain_calls  # the checkpointed Linear ran again in each backward


def test_lightning_reentrant_checkpointing_is_refused() -> None:
    strategy = DPStrategy(noise_multiplier=0.5, max_grad_norm=0.5, seed=3)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        make_trainer(strategy, max_steps=1).fit(CheckpointedRegressor(True, use_reentrant=True))


def test_dptrainer_gradient_checkpointing_with_and_without_the_cap_equals_the_plain_run(tmp_path) -> None:
    runs = []
    for checkpointing, cap in ((False, None), (True, None), (True, 3)):
        model = tiny_llama(layers=2)
        calls: list[int] = []
        model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        privacy = PrivacyArguments(
            noise_multiplier=0.5, per_sample_max_grad_norm=0.5, accountant="rdp", dp_seed=0, max_physical_batch_size=cap
        )
        trainer = make_hf_trainer(
            model, tmp_path, privacy=privacy, args={"gradient_checkpointing": checkpointing, "max_steps": 2}
        )
        trainer.train()
        runs.append((trainable_snapshot(model), len(calls)))
    (plain, plain_calls), *others = runs
    for recomputed, recomputed_calls in others:
        for name, value in plain.items():
            torch.testing.assert_close(recomputed[name], value, rtol=1e-5, atol=1e-6, msg=name)
        assert recomputed_calls > plain_calls


def test_dptrainer_refuses_reentrant_checkpointing_at_construction(tmp_path) -> None:
    with pytest.raises(ValueError, match="use_reentrant=False"):
        make_hf_trainer(
            tiny_llama(),
            tmp_path,
            args={"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}},
        )
