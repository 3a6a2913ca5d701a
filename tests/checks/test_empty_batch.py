"""A training step that fails on an empty batch fails at the first step, whatever its draw (docs/design.md section
9.1): Poisson sampling draws empty batches at some steps, and such a step failed only at those draws (found in
review), an error whose step said that its batch was empty."""

from __future__ import annotations

import pytest
import torch
from helpers import TinyRegressor, make_trainer
from torch import nn

from lightning_dp.checks.empty_batch import EMPTY_BATCH_HINT, check_empty_batch
from lightning_dp.data.poisson import empty_like_batch
from lightning_dp.lightning import DPStrategy


class ViewedRegressor(TinyRegressor):
    """Flattens its input with ``x.view(x.size(0), -1)``, which fails on zero rows."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return ((self.net(x.view(x.size(0), -1)) - y) ** 2).squeeze(-1)


def test_an_empty_batch_keeps_0_dim_tensors_and_cuts_the_others() -> None:
    batch = {"x": torch.ones(3, 2), "scale": torch.tensor(2.0), "pair": (torch.ones(3), "text")}
    empty = empty_like_batch(batch)
    assert empty["x"].shape == (0, 2) and empty["scale"].shape == () and empty["pair"][0].shape == (0,)
    assert empty["pair"][1] == "text"


def test_a_step_that_fails_on_zero_rows_is_named_and_the_global_rng_restored() -> None:
    module = nn.Linear(4, 1)
    batch = torch.randn(3, 2, 2)
    before = torch.random.get_rng_state()
    with pytest.raises(ValueError, match="failed on an empty batch .RuntimeError") as raised:
        check_empty_batch(lambda x: module(torch.rand(1) * x.view(x.size(0), -1)).squeeze(-1), batch, module)
    assert EMPTY_BATCH_HINT in str(raised.value) and isinstance(raised.value.__cause__, RuntimeError)
    assert torch.equal(torch.random.get_rng_state(), before)
    check_empty_batch(lambda x: module(x.flatten(1)).squeeze(-1), batch, module)  # zero rows: fine
    with pytest.raises(ValueError, match=r"shape \(\) on an empty batch"):
        check_empty_batch(lambda x: module(x.flatten(1)).sum(), batch, module)


@pytest.mark.parametrize("poisson_sampling", [True, False])
def test_dpstrategy_runs_the_step_on_an_empty_batch_at_the_first_step(poisson_sampling: bool) -> None:
    """Batches of 8 expected out of 64: an empty one is almost never drawn, yet the check runs at the first step; with
    the user's own sampler no empty batch is drawn and nothing is checked."""
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=poisson_sampling, seed=0)
    trainer = make_trainer(strategy, max_steps=2)
    if poisson_sampling:
        with pytest.raises(ValueError, match="failed on an empty batch"):
            trainer.fit(ViewedRegressor())
        assert strategy.privacy_engine.steps == 0
    else:
        trainer.fit(ViewedRegressor())
        assert strategy.privacy_engine.steps == 2
