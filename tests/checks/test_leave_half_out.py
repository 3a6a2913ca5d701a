"""The leave-half-out check cannot fail because of one example's values or because one example changes the batch
size (docs/privacy.md, "Run-time checks"), and still catches mixing without a gradient path: same-shape variants
(odd-indexed examples replaced by their even neighbours, and the mirror image) must leave the kept losses bit for bit
unchanged, and the halves run alone must not show the signature of a division by a count over the batch."""

from __future__ import annotations

import logging
import math
from functools import reduce

import lightning.pytorch as pl
import pytest
import torch
from helpers import make_trainer
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.checks.guard import TrainingGuard
from lightning_dp.checks.independence import BatchMixingError
from lightning_dp.checks.leave_half_out import LEAVE_HALF_OUT_FORWARDS, LEAVE_HALF_OUT_MIN_BATCH, check_leave_half_out
from lightning_dp.lightning import DPStrategy

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
    other examples' positions and the kernels' blocking): never a raise; a conclusive pass unless a half of the batch
    is left without a loss to compare (a crafted or zero row alone, or with the other, in a half of one or two)."""
    module = nn.Identity()
    assert check_leave_half_out(per_example, batch((), size), size, module) is True
    for crafted in [(), *((row,) for row in range(size))]:
        for zero in [(), (size - 1,)]:
            x = batch(crafted, size, zero_rows=[row for row in zero if row not in crafted])
            conclusive = check_leave_half_out(per_example, x, size, module)
            assert conclusive or size <= 4, (crafted, zero)


def test_crafted_examples_filling_one_half_do_not_fail_the_count_test() -> None:
    """The count test needs a common factor in BOTH halves whose reciprocals add up to 1 (a division by a count):
    examples whose own losses round differently with the batch size, even all of one half, do not give that."""
    for crafted in [(0, 2, 4, 6), (0, 2, 4, 6, 7), (1, 3, 5), (0, 1, 2, 3, 4, 5, 6)]:
        check_leave_half_out(per_example, batch(crafted, size=8), 8, nn.Identity())  # no raise


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
    """The values test sees every case; a count alone (a loss divided by the batch size) with zero or crafted losses
    making up half of a half is inconclusive on that batch, and raises on one without them."""
    x = batch(crafted_rows, zero_rows=zero_rows)
    if loss is divided_by_batch_size and crafted_rows:
        assert check_leave_half_out(loss, x, 8, nn.Identity()) is False
        x = batch()
    with pytest.raises(BatchMixingError, match=r"leave-half-out check: .*(depends? on|count over the batch)"):
        check_leave_half_out(loss, x, 8, nn.Identity())


@pytest.mark.parametrize("size", [2, 3])
def test_a_count_dependence_is_caught_in_the_smallest_batches(size: int) -> None:
    """Both halves are compared, so a batch of two compares two examples."""
    with pytest.raises(BatchMixingError, match=r"losses each grew by one common factor"):
        check_leave_half_out(divided_by_batch_size, batch(size=size), size, nn.Identity())


def test_each_test_says_what_it_saw() -> None:
    with pytest.raises(BatchMixingError, match=r"odd-indexed examples by copies of their neighbours changed the loss"):
        check_leave_half_out(detached_centered, batch(), 8, nn.Identity())
    with pytest.raises(BatchMixingError, match=r"each grew by one common factor, and the two factors' reciprocals"):
        check_leave_half_out(divided_by_batch_size, batch(), 8, nn.Identity())


def test_mixing_that_reaches_only_odd_indexed_examples_is_caught_by_the_mirrored_variant() -> None:
    """A statistic that reaches example 3 only: the even-indexed losses never change; the mirror image (even rows
    replaced by their odd neighbours) shows it."""

    def reaches_three(x: torch.Tensor) -> torch.Tensor:
        gate = torch.zeros(x.shape[0], 1)
        gate[3:4] = 1.0
        return ordered_sum(x - gate * x.mean(0).detach())

    with pytest.raises(BatchMixingError, match=r"even-indexed examples by copies .* example 3, one of the odd-indexed"):
        check_leave_half_out(reaches_three, batch(), 8, nn.Identity())


def test_a_forward_that_does_not_reproduce_its_bits_is_still_count_checked() -> None:
    """Bits that change between two runs of the same batch cannot be compared: the values test is skipped, silently,
    and the count test still runs."""
    calls = []

    def drifting(x):
        calls.append(1)
        return per_example(x) + 1e-6 * len(calls)

    assert check_leave_half_out(drifting, batch(), 8, nn.Identity()) is True
    assert len(calls) == LEAVE_HALF_OUT_FORWARDS
    with pytest.raises(BatchMixingError, match="each grew by one common factor"):
        check_leave_half_out(lambda x: drifting(x) / x.shape[0], batch(), 8, nn.Identity())


def test_shapes_that_follow_the_values_skip_the_values_test() -> None:
    """A per-example model that picks rows by value (a head applied to the labelled positions only, as sparse
    prediction heads do): copying rows changes the shapes the kernels see, so bits are not comparable and the values
    test is skipped; a detached statistic in such a model is then seen only on a batch whose variants keep the
    shapes."""
    head = nn.Linear(3, 1)

    def labelled_only(x: torch.Tensor) -> torch.Tensor:
        rows = x[:, 0] > 0  # the "labelled" examples
        out = torch.zeros(x.shape[0])
        out[rows] = head(x[rows]).squeeze(-1)
        return out + x.sum(-1)

    x = batch()
    assert bool((x[0::2, 0] > 0).sum() != (x[:, 0] > 0).sum() / 2)  # the copies change how many rows the head sees
    assert check_leave_half_out(labelled_only, x, 8, nn.Identity()) is True
    mixing = lambda data: labelled_only(data - data.mean(0).detach())  # noqa: E731
    check_leave_half_out(mixing, x, 8, nn.Identity())  # skipped here: no raise
    same = x.clone()
    same[:, 0] = 1.0  # every row "labelled": the copies keep the shapes
    with pytest.raises(BatchMixingError, match="copies of their neighbours changed"):
        check_leave_half_out(mixing, same, 8, nn.Identity())


def test_a_step_that_skips_a_half_is_inconclusive() -> None:
    assert (
        check_leave_half_out(lambda x: None if x.shape[0] < 8 else per_example(x), batch(), 8, nn.Identity()) is False
    )


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


def test_one_crafted_example_alone_in_its_half_cannot_fake_a_count() -> None:
    """A loss whose value explodes in a half of one (an exponential rate, a crafted input): its factor is huge, the
    other half's is 1, and 1/huge + 1/1 is about 1; the factors must both be above 1, so it is no count."""

    def exploding(x: torch.Tensor) -> torch.Tensor:
        value = per_example(x)
        return torch.where(value.abs() > 1e7, value, 1.0 + 0.0 * value) * (1e9 if x.shape[0] == 1 else 1.0)

    for size in (2, 3):
        x = batch(size=size)
        x[1] = 1e8
        assert check_leave_half_out(exploding, x, size, nn.Identity()) is True


def test_zero_losses_count_against_a_count_signature() -> None:
    """A majority of each half must share the factor, zero losses included: two crafted examples (one per half)
    among zero-loss rows are not a majority, so no raise; the batch is inconclusive (checked again later)."""

    def doubled_when_alone(x: torch.Tensor) -> torch.Tensor:
        crafted = x[:, 0] > 1e7
        return torch.where(crafted, torch.full_like(x[:, 0], 2.0 if x.shape[0] < 8 else 1.0), torch.zeros_like(x[:, 0]))

    x = batch((0, 1), size=8)
    assert check_leave_half_out(doubled_when_alone, x, 8, nn.Identity()) is False


def test_a_non_contiguous_batch_is_compared_as_fresh_copies() -> None:
    """A batch tensor that is a view (here transposed) runs other kernels than contiguous row copies; every forward
    gets copies with the same layout, so a per-example model passes."""
    layer = nn.Linear(32, 1)
    x = torch.randn(32, 8).t()  # [8, 32], not contiguous
    x[3] = 1e8 * torch.sign(torch.randn(32))
    assert not x.is_contiguous()
    assert check_leave_half_out(lambda data: layer(data).squeeze(-1), x, 8, layer) is True


def test_each_submodule_keeps_its_own_train_or_eval_mode() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.5), nn.Linear(3, 1))
    model.train()
    model[1].eval()  # a frozen part the user put in eval mode
    check_leave_half_out(lambda data: model(data).squeeze(-1), batch(), 8, model)
    assert [m.training for m in model] == [True, False, True] and model.training


def test_each_variant_is_gated_on_its_own_calls() -> None:
    """A branch that one variant takes and the other does not (HF's shortcut for an all-ones mask): the variant
    whose calls match still compares, so mixing in such a model is caught."""

    def shortcut_then_mixing(x: torch.Tensor) -> torch.Tensor:
        if bool((x[1::2, 0] > 0).all()):  # a branch on the odd rows' values
            x = x * 1.0
        return ordered_sum(x - x.mean(0).detach())

    x = batch()
    x[1::2, 0] = 1.0  # the batch takes the branch; the odd-replaced variant (odd rows = even rows) does not
    x[0::2, 0] = -1.0
    with pytest.raises(BatchMixingError, match="even-indexed examples by copies"):
        check_leave_half_out(shortcut_then_mixing, x, 8, nn.Identity())


def test_the_guard_never_runs_the_step_on_one_example_the_draw_did_not_give() -> None:
    """Halves of one example (batches of 2 or 3) ran the user's step on one example: a step that fails there (a
    ``.squeeze()``) raised only at the draws of 2 or 3 examples (found in review). The guard waits for a batch of
    ``LEAVE_HALF_OUT_MIN_BATCH`` examples, whose halves have two or more."""
    module = nn.Identity()
    guard = TrainingGuard(module, dict)
    sizes: list[int] = []

    def recorded(x: torch.Tensor) -> torch.Tensor:
        sizes.append(x.shape[0])
        return per_example(x)

    for size in range(2, LEAVE_HALF_OUT_MIN_BATCH):
        guard.leave_half_out(recorded, batch(size=size), size, module)
        assert guard.leave_half_out_pending and not sizes
    guard.leave_half_out(recorded, batch(size=LEAVE_HALF_OUT_MIN_BATCH), LEAVE_HALF_OUT_MIN_BATCH, module)
    assert not guard.leave_half_out_pending and min(sizes) == 2


class SqueezedRegressor(RowsRegressor):
    """``[B]`` for two examples or more, a 0-dim loss for one (``.squeeze()``), which the strategy refuses."""

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return ((ordered_sum(self.layer(x)) - 1.0) ** 2).reshape(-1, 1).squeeze()

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.rows), batch_size=3)


def test_a_step_that_fails_on_one_example_trains_when_no_draw_has_one() -> None:
    module = SqueezedRegressor(batch(size=12))
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False)
    make_trainer(strategy, max_steps=3).fit(module)
    assert module.modes.count(False) == 0  # batches of 3: the check stays pending, the step never sees one example
