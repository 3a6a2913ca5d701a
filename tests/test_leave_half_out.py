"""The leave-half-out check cannot fail because of one example's values (docs/privacy.md, "Run-time checks"): a
difference on only some of the compared examples is inconclusive (checked again later), mixing that changes every
compared example's loss still raises."""

from __future__ import annotations

import logging
from functools import reduce

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.checks.guard import TrainingGuard
from lightning_dp.checks.independence import BatchMixingError, check_leave_half_out
from lightning_dp.lightning import DPStrategy
from tests.helpers import make_trainer

#: sums to 1 exactly; in float32 left to right gives 1, right to left 0 (1 - 1e8 rounds to -1e8).
CRAFTED = [1e8, -1e8, 1.0]


def ordered_sum(h: torch.Tensor) -> torch.Tensor:
    """Row sums of ``h`` ``[B, d]`` in an order chosen by the batch size, as a matrix kernel that blocks by the
    number of rows does: each row's sum depends on that row alone, its rounding on ``B``."""
    columns = list(h.unbind(-1))
    return reduce(torch.add, columns if h.shape[0] > 4 else columns[::-1])


def batch(crafted_rows: tuple[int, ...] = (), size: int = 8, zero_rows: tuple[int, ...] = ()) -> torch.Tensor:
    x = torch.randn(size, 3, generator=torch.Generator().manual_seed(0))
    for row in crafted_rows:
        x[row] = torch.tensor(CRAFTED)
    for row in zero_rows:
        x[row] = 0.0
    return x


def per_example(x: torch.Tensor) -> torch.Tensor:
    return ordered_sum(x)


def divided_by_batch_size(x: torch.Tensor) -> torch.Tensor:
    """Mixing without a gradient path: each loss divided by the number of examples (a batch-wide count)."""
    return ordered_sum(x) / x.shape[0]


def detached_centered(x: torch.Tensor) -> torch.Tensor:
    return ordered_sum(x - x.mean(0).detach())


def test_the_crafted_example_rounds_differently_with_and_without_the_odd_examples() -> None:
    """The premise: its loss is 1 in a batch of 8 and 0 in the batch of its 4 even-indexed examples, while the
    ordinary examples' losses agree; a per-example tolerance would raise exactly when it is drawn."""
    x = batch(crafted_rows=(2,))
    full, half = per_example(x), per_example(x[::2])
    assert (full[2], half[1]) == (1.0, 0.0)
    assert torch.allclose(full[::2][[0, 2, 3]], half[[0, 2, 3]], rtol=1e-6)


@pytest.mark.parametrize("crafted_rows", [(0,), (2,), (0, 1, 6), (4, 5)])
def test_an_example_whose_own_loss_rounds_differently_raises_nothing(crafted_rows) -> None:
    module = nn.Identity()
    assert check_leave_half_out(per_example, batch(), 8, module) is True
    assert check_leave_half_out(per_example, batch(crafted_rows), 8, module) is (set(crafted_rows) <= {1, 3, 5, 7})


@pytest.mark.parametrize("loss", [divided_by_batch_size, detached_centered])
@pytest.mark.parametrize("crafted_rows, zero_rows", [((), ()), ((2,), (4,)), ((0,), (2, 4))])
def test_mixing_that_changes_every_compared_loss_still_raises(loss, crafted_rows, zero_rows) -> None:
    """Neither a crafted example nor an example with a zero loss (which no rescaling changes) hides the mixing."""
    x = batch(crafted_rows, zero_rows=zero_rows if loss is divided_by_batch_size else ())
    with pytest.raises(BatchMixingError, match=r"leave-half-out check: .* every kept example changed \(\d compared"):
        check_leave_half_out(loss, x, 8, nn.Identity())


def test_one_compared_example_is_inconclusive_two_suffice() -> None:
    assert check_leave_half_out(divided_by_batch_size, batch(size=2), 2, nn.Identity()) is False
    with pytest.raises(BatchMixingError):
        check_leave_half_out(divided_by_batch_size, batch(size=3), 3, nn.Identity())


def test_the_guard_checks_again_after_a_partial_difference_until_a_batch_concludes() -> None:
    module = nn.Identity()
    guard = TrainingGuard(module, dict)
    for x, pending in [(batch((0,)), True), (batch((2,)), True), (batch(), False)]:
        guard.leave_half_out(per_example, x, 8, module)
        assert (guard.leave_half_out_pending, guard.unresolved) == (pending, pending)
    guard.leave_half_out(per_example, batch((0,)), 8, module)  # concluded: not run again
    assert not guard.unresolved


class RoundingRegressor(pl.LightningModule):
    """A trainable identity layer, then the batch-size-ordered sum against a target of 1: the crafted examples' loss
    is 0 in batches of more than four examples and 1 in smaller ones."""

    def __init__(self, rows: torch.Tensor) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 3, bias=False)
        with torch.no_grad():
            self.layer.weight.copy_(torch.eye(3))
        self.rows = rows
        self.modes: list[bool] = []

    def training_step(self, batch, batch_idx):
        (x,) = batch
        self.modes.append(self.training)
        return (ordered_sum(self.layer(x)) - 1.0) ** 2

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.rows), batch_size=8)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_a_run_whose_check_never_concludes_trains_and_says_so_at_the_end(caplog) -> None:
    """Every batch holds crafted and ordinary examples at even positions: the check runs on every step, never
    raises, and one warning at the end says that it did not conclude."""
    rows = batch(crafted_rows=range(0, 64, 4), size=64)
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False)
    module = RoundingRegressor(rows)
    with caplog.at_level(logging.WARNING, logger="lightning_dp"):
        make_trainer(strategy, max_steps=3).fit(module)
    assert module.modes.count(False) == 6  # two leave-half-out forwards (eval mode) on each of the 3 steps
    messages = [r.getMessage() for r in caplog.records if "did not conclude" in r.getMessage()]
    assert len(messages) == 1 and "leave-half-out" in messages[0]
