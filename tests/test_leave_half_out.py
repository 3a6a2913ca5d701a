"""The leave-half-out check cannot fail because of one example's values or because one example changes the batch
size (docs/privacy.md, "Run-time checks"), and still catches mixing without a gradient path: a same-shape forward
with the odd-indexed examples replaced must leave the even-indexed losses bit for bit unchanged, and the halves run
alone must not change most losses by more than 10%."""

from __future__ import annotations

import logging
import math
from functools import reduce

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.checks.guard import TrainingGuard
from lightning_dp.checks.independence import LEAVE_HALF_OUT_FORWARDS, BatchMixingError, check_leave_half_out
from lightning_dp.lightning import DPStrategy
from tests.helpers import make_trainer

#: sums to 1 exactly; in float32 left to right gives 1, right to left 0 (1 - 1e8 rounds to -1e8).
CRAFTED = [1e8, -1e8, 1.0]


def ordered_sum(h: torch.Tensor) -> torch.Tensor:
    """Row sums of ``h`` ``[B, d]`` in an order chosen by the batch size, as a matrix kernel that blocks by the
    number of rows does: each row's sum depends on that row alone, its rounding on ``B``."""
    columns = list(h.unbind(-1))
    return reduce(torch.add, columns if h.shape[0] > 4 else columns[::-1])


def batch(crafted_rows=(), size: int = 8, zero_rows=()) -> torch.Tensor:
    x = torch.randn(size, 3, generator=torch.Generator().manual_seed(size))
    for row in crafted_rows:
        x[row] = torch.tensor(CRAFTED)
    for row in zero_rows:
        x[row] = 0.0
    return x


def per_example(x: torch.Tensor) -> torch.Tensor:
    return ordered_sum(x)


def divided_by_batch_size(x: torch.Tensor) -> torch.Tensor:
    """Mixing without a gradient path: each loss divided by the number of examples."""
    return ordered_sum(x) / x.shape[0]


def divided_by_token_count(x: torch.Tensor) -> torch.Tensor:
    """The common LM pattern: per-example token losses summed, divided by the batch's total token count."""
    mask = (x > -1).to(x.dtype)  # the "tokens" of each example
    return (x.abs() * mask).sum(1) / mask.sum()


def detached_centered(x: torch.Tensor) -> torch.Tensor:
    return ordered_sum(x - x.mean(0).detach())


def gated_statistic(x: torch.Tensor) -> torch.Tensor:
    """Mixing that reaches only some examples (those with a positive first feature)."""
    gate = (x[:, 0] > 0).to(x.dtype)[:, None]
    return ordered_sum(x - gate * x.mean(0).detach())


def test_the_crafted_example_rounds_differently_with_and_without_the_odd_examples() -> None:
    """The premise: its loss is 1 in a batch of 8 and 0 in the batch of its 4 even-indexed examples, while the
    ordinary examples' losses agree; a per-example tolerance on that comparison raised exactly when it was drawn."""
    x = batch(crafted_rows=(2,))
    full, half = per_example(x), per_example(x[::2])
    assert (full[2], half[1]) == (1.0, 0.0)
    assert torch.allclose(full[::2][[0, 2, 3]], half[[0, 2, 3]], rtol=1e-6)


@pytest.mark.parametrize("size", range(2, 13))
def test_no_example_and_no_batch_size_makes_a_per_example_model_fail(size: int) -> None:
    """A crafted example at every position or none, with and without a zero row, at every batch size (which moves the
    other examples' positions and the kernels' blocking): always a conclusive pass."""
    module = nn.Identity()
    for crafted in [(), *((row,) for row in range(size))]:
        for zero in [(), (size - 1,)]:
            x = batch(crafted, size, zero_rows=[row for row in zero if row not in crafted])
            assert check_leave_half_out(per_example, x, size, module) is True, (crafted, zero)


def test_a_majority_of_crafted_examples_can_make_the_count_test_fail() -> None:
    """The stated limit: examples whose own losses round differently with the batch size must be a strict majority
    of the compared ones to fail the check."""
    assert check_leave_half_out(per_example, batch((0, 2, 4), size=8), 8, nn.Identity()) is True
    with pytest.raises(BatchMixingError, match="5 of 8 examples"):
        check_leave_half_out(per_example, batch((0, 2, 4, 6, 7), size=8), 8, nn.Identity())


def test_a_real_mlp_with_cancelling_residuals_passes_at_every_batch_size() -> None:
    """A per-example float32 regression MLP with outputs about 1e3 and residuals about 1e-2: every loss rounds to a
    few per cent differently when the batch size changes the matrix kernels' blocking (a tolerance on the loss with
    and without half the batch raised at some batch sizes on ordinary data)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1))
    x = 3000 * torch.randn(40, 64)
    with torch.no_grad():
        y = model(x).squeeze(1) + 0.01 * torch.randn(40)

    def loss(data):
        inputs, targets = data
        return (model(inputs).squeeze(1) - targets) ** 2

    for size in range(2, 41):
        assert check_leave_half_out(loss, (x[:size], y[:size]), size, model) is True


@pytest.mark.parametrize("loss", [divided_by_batch_size, divided_by_token_count, detached_centered, gated_statistic])
@pytest.mark.parametrize("crafted_rows, zero_rows", [((), ()), ((2,), (4,)), ((0, 1), (2, 5))])
def test_mixing_still_raises_with_crafted_and_zero_loss_examples_in_the_batch(loss, crafted_rows, zero_rows) -> None:
    x = batch(crafted_rows, zero_rows=zero_rows)
    with pytest.raises(BatchMixingError, match=r"leave-half-out check: .*depends? on"):
        check_leave_half_out(loss, x, 8, nn.Identity())


@pytest.mark.parametrize("size", [2, 3])
def test_a_count_dependence_is_caught_in_the_smallest_batches(size: int) -> None:
    """Both halves are compared, so a batch of two compares two examples."""
    with pytest.raises(BatchMixingError, match=r"losses of \d of \d examples changed by more than 10%"):
        check_leave_half_out(divided_by_batch_size, batch(size=size), size, nn.Identity())


def test_values_test_names_the_example_and_the_count_test_the_share() -> None:
    with pytest.raises(BatchMixingError, match=r"copies of the even-indexed ones changed the loss of example 0 "):
        check_leave_half_out(detached_centered, batch(), 8, nn.Identity())
    with pytest.raises(BatchMixingError, match=r"the losses of 8 of 8 examples changed by more than 10%"):
        check_leave_half_out(divided_by_batch_size, batch(), 8, nn.Identity())


def test_a_nondeterministic_forward_skips_the_same_shape_test_with_a_warning(caplog) -> None:
    """A forward whose bits change between two runs of the same batch cannot be compared bit for bit; the count
    test still runs."""
    calls = []

    def drifting(x):
        calls.append(1)
        return per_example(x) + 1e-6 * len(calls)

    with caplog.at_level(logging.WARNING, logger="lightning_dp"):
        assert check_leave_half_out(drifting, batch(), 8, nn.Identity()) is True
    assert len(calls) == LEAVE_HALF_OUT_FORWARDS and "gave different bits twice" in caplog.text
    with pytest.raises(BatchMixingError, match="changed by more than 10%"):
        check_leave_half_out(lambda x: drifting(x) / x.shape[0], batch(), 8, nn.Identity())


def test_a_non_finite_loss_leaves_the_guard_pending_until_a_batch_concludes() -> None:
    module = nn.Identity()
    guard = TrainingGuard(module, dict)
    with_nan = batch()
    with_nan[3, 0] = math.nan
    for x, pending in [(with_nan, True), (batch(crafted_rows=(0,)), False)]:
        guard.leave_half_out(per_example, x, 8, module)
        assert (guard.leave_half_out_pending, guard.unresolved) == (pending, pending)


class RowsRegressor(pl.LightningModule):
    """A trainable identity layer, then the batch-size-ordered sum against a target of 1, on fixed batches of 8."""

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


def _fit(rows: torch.Tensor, caplog) -> RowsRegressor:
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False)
    module = RowsRegressor(rows)
    with caplog.at_level(logging.WARNING, logger="lightning_dp"):
        make_trainer(strategy, max_steps=3).fit(module)
    return module


def test_a_run_with_crafted_examples_checks_once_and_trains(caplog) -> None:
    module = _fit(batch(crafted_rows=range(0, 64, 4), size=64), caplog)
    assert module.modes.count(False) == LEAVE_HALF_OUT_FORWARDS  # the first step only
    assert "did not conclude" not in caplog.text


def test_a_run_whose_check_never_concludes_says_so_once_at_the_end(caplog) -> None:
    """Every batch holds an example with a non-finite loss: the check runs again on every step, never raises, and
    one warning at the end says that it did not conclude."""
    rows = batch(size=64)
    rows[::8, 0] = math.inf
    module = _fit(rows, caplog)
    assert module.modes.count(False) == 3 * LEAVE_HALF_OUT_FORWARDS
    assert sum("did not conclude" in r.getMessage() for r in caplog.records) == 1
