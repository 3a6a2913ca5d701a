"""Examples whose per-sample loss, norm or terms are not finite contribute nothing to the clipped sum.

The leak this closes: an input whose per-sample gradient overflows has norm inf, factor 0, and ``0 * inf = NaN``
turned the whole release into NaN exactly when that input was sampled (membership revealed with certainty). Each
engine, with and without per-sample momentum, must give finite parameters and the clipped sum of the batch with that
example removed (the oracle), without raising.
"""

from __future__ import annotations

import copy
import logging
import math

import lightning.pytorch as pl
import pytest
import torch
from clipping_helpers import FunctionalReuse, TiedLM, randomise
from helpers import CoshModule, make_trainer
from process_helpers import fit_on_two_processes
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy
from lightning_dp.checks.independence import BatchMixingError, check_batch_independence
from lightning_dp.checks.leave_half_out import check_leave_half_out
from lightning_dp.clipping import PerSampleClipper, UnsupportedModuleError, rows
from lightning_dp.clipping.terms import Factored, finite
from lightning_dp.mechanisms import make_mechanism
from lightning_dp.optim import DPOptimizer, DPRandomness

ENGINES = ("flat", "ghost", "fgc", "mixed", "hutch", "hutchpp")
POISONED = 2
B = 5


def _clipper(model: nn.Module, clipping: str) -> PerSampleClipper:
    randomized = clipping in ("hutch", "hutchpp")
    return PerSampleClipper(
        model,
        clipping=clipping,
        max_grad_norm=0.5,
        projection_dim=4 if randomized else None,
        generator_for=DPRandomness(7).projection_generator if randomized else None,
    )


def _linear_cosh() -> tuple[nn.Module, tuple[torch.Tensor, ...], callable]:
    """The reproduction in float64: ``nn.Linear(3, 2)``, loss ``cosh(out).sum(-1)``, one input set to 1e5 (its
    loss is inf; 1e3 suffices in float32)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    x = torch.randn(B, 3, dtype=torch.float64)
    x[POISONED] = 1e5
    return model, (x,), lambda m, x: torch.cosh(m(x)).sum(-1)


def _tied_lm_temperature() -> tuple[nn.Module, tuple[torch.Tensor, ...], callable]:
    """Tied embedding/head on sequences (token-id factors, ghost path with T > 1) with a per-example temperature
    in the data: the poisoned example's logits are scaled by 1e3, so its loss and output gradients are inf."""
    model = randomise(TiedLM(vocab=7, dim=4, seq=6))
    ids = torch.randint(0, 7, (B, 6), generator=torch.Generator().manual_seed(3))
    scale = torch.ones(B, dtype=torch.float64)
    scale[POISONED] = 1e3
    return model, (ids, scale), lambda m, ids, s: torch.cosh(m(ids) * s.view(-1, 1, 1)).sum((1, 2))


def _mlp_nan_input() -> tuple[nn.Module, tuple[torch.Tensor, ...], callable]:
    """A NaN in one example's input: NaN activations in every layer and a NaN loss."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.LayerNorm(4), nn.Linear(4, 2)).double()
    x = torch.randn(B, 3, dtype=torch.float64)
    x[POISONED, 0] = math.nan
    return model, (x,), lambda m, x: m(x).sin().sum(-1)


CASES = {"linear_cosh": _linear_cosh, "tied_lm_temperature": _tied_lm_temperature, "mlp_nan_input": _mlp_nan_input}


def _clipped_sum(model, inputs, loss_fn, clipping, rows=None, momentum_weight=None):
    """``{name: p.grad}`` after one clipped backward on ``inputs`` (restricted to ``rows``), with one past iterate
    (a perturbed copy of the parameters) when ``momentum_weight`` is given."""
    model = copy.deepcopy(model)
    inputs = tuple(t[rows] for t in inputs) if rows is not None else inputs
    clipper = _clipper(model, clipping)
    weight = 1.0
    if momentum_weight is not None:
        with torch.no_grad():
            saved = [p.clone() for p in model.parameters()]
            for p in model.parameters():
                p.mul_(0.9)
        clipper.add_past_iterate(loss_fn(model, *inputs), momentum_weight)
        with torch.no_grad():
            for p, s in zip(model.parameters(), saved, strict=True):
                p.copy_(s)
        weight = 1.0 - momentum_weight
    loss = loss_fn(model, *inputs)
    norms = clipper.backward(loss, weight=weight)
    return {name: p.grad.clone() for name, p in model.named_parameters()}, norms, clipper


@pytest.mark.parametrize("clipping", ENGINES)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("momentum", [False, True], ids=["sgd", "momentum"])
def test_nonfinite_example_contributes_nothing(case: str, clipping: str, momentum: bool) -> None:
    model, inputs, loss_fn = CASES[case]()
    weight = 0.4 if momentum else None
    with torch.no_grad():
        assert not torch.isfinite(loss_fn(model, *inputs)[POISONED])
    grads, norms, clipper = _clipped_sum(model, inputs, loss_fn, clipping, momentum_weight=weight)
    others = [i for i in range(B) if i != POISONED]
    oracle, oracle_norms, _ = _clipped_sum(model, inputs, loss_fn, clipping, others, weight)
    assert not torch.isfinite(norms[POISONED])
    assert clipper.dropped_nonfinite
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
        torch.testing.assert_close(grad, oracle[name], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(norms[others], oracle_norms, rtol=1e-10, atol=0)


@pytest.mark.parametrize("clipping", ENGINES)
def test_finite_batch_is_unchanged_and_not_flagged(clipping: str) -> None:
    model, inputs, loss_fn = _linear_cosh()
    others = [i for i in range(B) if i != POISONED]
    _, _, clipper = _clipped_sum(model, inputs, loss_fn, clipping, others)
    assert not clipper.dropped_nonfinite


def test_finite_loss_with_overflowing_norm_is_dropped() -> None:
    """Finite terms whose squared norm overflows float32: the norm is inf, the sample is dropped, the rest summed."""
    model = nn.Linear(2, 1, bias=False)
    x = torch.tensor([[1.0, 0.0], [3e19, 3e19]])
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    norms = clipper.backward(model(x).squeeze(1))
    assert math.isinf(norms[1]) and clipper.dropped_nonfinite
    # the kept sample (norm 1 = C) is clipped at C over its norm's float32 rounding bound (docs/design.md 4.10)
    torch.testing.assert_close(model.weight.grad, torch.tensor([[1.0, 0.0]]), rtol=1e-4, atol=0)


def test_sum_check_is_postponed_past_a_nonfinite_batch() -> None:
    """A batch with a non-finite example neither raises (that would reveal it was sampled) nor counts as checked:
    the next batch runs the sum check, which still catches a parameter used outside its layer."""
    model = FunctionalReuse().double()
    clipper = PerSampleClipper(model, max_grad_norm=1.0, sum_check_every=100)
    x = torch.randn(4, 5, dtype=torch.float64)
    x[1] = 1e5
    clipper.backward(torch.cosh(model(x)).sum(1))
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert clipper.sum_check_postponed  # reported at the end of a run if no later check runs
    with pytest.raises(UnsupportedModuleError, match="outside the forward"):
        clipper.backward(torch.cosh(model(x[[0, 2, 3]])).sum(1))


# ----------------------------------------------------------------------------------------- whole runs
def test_strategy_run_stays_finite_and_reports_once(caplog) -> None:
    """sigma = 1, q = 0.2: the run samples the overflowing example, stays finite, and says so once at the end."""
    module = CoshModule()
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    with caplog.at_level(logging.WARNING, logger="lightning_dp"):
        make_trainer(strategy, max_steps=15).fit(module)
    assert strategy.privacy_engine.dropped_nonfinite
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert sum("non-finite loss or gradient" in r.getMessage() for r in caplog.records) == 1


def test_two_processes_stay_finite_and_identical(tmp_path) -> None:
    """DPDDPStrategy on 2 processes, example 3 NaN, q = 0.5 over 6 steps: the rank that draws it drops it."""
    ranks = fit_on_two_processes(tmp_path, "--poison")
    assert any(rank["dropped_nonfinite"] for rank in ranks)
    for p, q, start in zip(ranks[0]["params"], ranks[1]["params"], ranks[0]["initial"], strict=True):
        assert torch.isfinite(p).all() and torch.equal(p, q) and not torch.equal(p, start)


def test_non_finite_clipped_sum_raises_before_noise() -> None:
    """A non-finite value that did not come through per-sample clipping stops the step before the noise."""
    layer = nn.Linear(3, 2)
    layer.weight.grad = torch.zeros(2, 3)
    layer.bias.grad = torch.tensor([0.0, math.inf])
    optimizer = DPOptimizer(
        torch.optim.SGD(layer.parameters(), lr=1.0),
        mechanism=make_mechanism("gaussian", max_grad_norm=1.0, noise_multiplier=1.0),
        expected_batch_size=4.0,
        randomness=DPRandomness(0),
    )
    with pytest.raises(FloatingPointError, match=r"#1 \(2,\).*not finite before the noise"):
        optimizer.step()
    assert torch.equal(layer.weight.grad, torch.zeros(2, 3))  # nothing noised, nothing stepped
    with pytest.raises(FloatingPointError):  # caught and stepped again: it fails again, nothing released
        optimizer.step()
    layer.bias.grad = torch.zeros(2)  # a caller that repairs the gradient and steps again gets the noise
    weight = layer.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(layer.weight.detach(), weight) and not torch.equal(layer.weight.grad, torch.zeros(2, 3))


# ------------------------------------------------------------------------------- the first-step checks
def test_batch_independence_check_ignores_a_nonfinite_example_without_going_blind() -> None:
    """The example with an infinite loss neither fails the check nor hides the mixing of the others."""
    layer = nn.Linear(3, 2)
    x = torch.randn(5, 3)
    x[4] = 1e3
    independent = x.clone().requires_grad_()
    check_batch_independence(torch.cosh(layer(independent)).sum(-1), {"input": (independent, independent.shape)})
    mixed = x.clone().requires_grad_()
    pairs = mixed + 0.1 * mixed[[1, 0, 3, 2, 4]]  # 0 <-> 1 and 2 <-> 3 mix; 4 (inf loss) only with itself
    with pytest.raises(BatchMixingError, match="example [0-3]'s input"):
        check_batch_independence(torch.cosh(layer(pairs)).sum(-1), {"input": (mixed, mixed.shape)})


def test_leave_half_out_accepts_an_example_with_a_nan_loss() -> None:
    layer = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    x[2, 0] = math.nan
    check_leave_half_out(lambda batch: layer(batch).sin().sum(-1), x, 4, layer)


class GlobalMixing(pl.LightningModule):
    """``h - h.mean(0)`` with a NaN example in the first batch: every loss of that batch is NaN."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(3, 1)
        x = torch.randn(8, 3)
        x[0, 0] = math.nan
        self.data = TensorDataset(x)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        h = self.layer(x).squeeze(-1)
        return (h - h.mean(0)) ** 2

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_independence_checks_wait_for_a_batch_with_finite_losses() -> None:
    """A non-finite first batch cannot switch the first-step checks off. The gradient check is inconclusive on it
    (every loss is NaN); the leave-half-out values test is not: with the NaN example replaced by a copy of its
    neighbour the other examples' losses become finite, so the mixing shows on that batch."""
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, poisson_sampling=False)
    trainer = make_trainer(strategy, max_steps=2)
    with pytest.raises(BatchMixingError, match="leave-half-out check: replacing the even-indexed examples"):
        trainer.fit(GlobalMixing())
    assert trainer.global_step == 0


@pytest.mark.parametrize("clipping", ENGINES)
def test_zeroing_writes_only_the_clippers_own_gradients(clipping: str) -> None:
    """The sum zeroes non-finite entries in place only in the captured output gradients: the user's input (the first
    layer's activation, NaN in one example) and the model keep their values."""
    model, inputs, loss_fn = _mlp_nan_input()
    before = [t.clone() for t in inputs]
    state = copy.deepcopy(model.state_dict())
    _clipped_sum(model, inputs, loss_fn, clipping)
    for given, kept in zip(inputs, before, strict=True):
        torch.testing.assert_close(given, kept, equal_nan=True, rtol=0, atol=0)
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name


def test_finite_zeroes_in_place_only_what_is_writable() -> None:
    """``finite``: in place on a writable contiguous tensor, a copy otherwise (another tensor, or an expanded one
    whose elements share memory); finite entries keep their bits."""
    x = torch.tensor([[1.5, math.nan], [math.inf, -2.0]])
    out = finite(x, lambda t: True)
    assert out is x and torch.equal(x, torch.tensor([[1.5, 0.0], [0.0, -2.0]]))
    y = torch.tensor([[1.5, -math.inf]])
    out = finite(y, lambda t: False)
    assert out is not y and torch.isinf(y[0, 1]) and torch.equal(out, torch.tensor([[1.5, 0.0]]))
    expanded = torch.tensor([math.nan, 1.0]).expand(3, 2)
    out = finite(expanded, lambda t: True)
    assert torch.isnan(expanded[0, 0]) and torch.equal(out, torch.tensor([[0.0, 1.0]] * 3))


@pytest.mark.parametrize("gathering", [True, False], ids=["cpu-write", "device-pass"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_finite_with_noted_squares_zeroes_the_nonfinite_rows_bit_for_bit(
    dtype: torch.dtype, gathering: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``finite`` given the squared row norms a Gram diagonal noted: in place, every row whose squared norm is not
    finite (a non-finite entry, or finite entries whose squares overflow) becomes +0 entirely; every other row keeps
    its bits (-0, subnormals); the tensor itself is returned. Not writable: ``nan_to_num`` in a copy, as before. The
    CPU's write of those rows alone and a GPU's bitwise pass over every entry (run here on the CPU) give the same
    bits."""
    if not gathering:
        monkeypatch.setattr(rows, "GATHERING_DEVICES", frozenset())
    tiny = torch.finfo(dtype).tiny / 4
    x = torch.tensor(
        [[[1.5, -0.0, tiny], [math.nan, 1.0, 2.0]], [[-math.inf, 3.0, 0.0], [-7.0, 1e-3, 0.25]]], dtype=dtype
    )  # [B=2, T=2, n=3]
    before = x.clone()
    squares = x.float().pow(2).sum(-1)  # [2, 2]: rows (0, 1) and (1, 0) not finite
    squares[1, 1] = math.inf  # a finite row whose squares overflowed: zeroed as well (its sample is dropped)
    out = finite(x, lambda t: True, squares)
    assert out is x
    assert torch.equal(x[0, 0].view(torch.uint8), before[0, 0].view(torch.uint8))  # the same bits, -0 included
    for b, t in [(0, 1), (1, 0), (1, 1)]:
        assert torch.equal(x[b, t].view(torch.uint8), torch.zeros(3, dtype=dtype).view(torch.uint8))
    y = before.clone()
    copy_ = finite(y, lambda t: False, squares)
    assert copy_ is not y and torch.equal(y.view(torch.uint8), before.view(torch.uint8))
    assert torch.equal(copy_, torch.nan_to_num(before, 0.0, 0.0, 0.0))
    with pytest.raises(ValueError, match="do not match the rows"):
        finite(before.clone(), lambda t: True, squares[:, :1])  # [B, 1] would broadcast over whole examples


def test_a_kept_sample_whose_scaled_factor_overflows_is_not_zeroed() -> None:
    """Only the entries non-finite before the scaling are zeroed: a kept sample (factor 1e30) whose scaled entry
    overflows float32 makes the sum infinite (the finite check of the sums reports it) rather than silently dropping
    part of its gradient; the dropped sample's inf adds nothing."""
    left = torch.tensor([[[1.0, 2.0]], [[math.inf, 1.0]]])  # [B=2, T=1, P=2]: sample 1 non-finite
    right = torch.tensor([[[1e10]], [[3.0]]])  # [B, T, Q=1], the narrower factor: scaled
    total = Factored(left, right, torch.Size([2, 1])).batch_sum(torch.tensor([1e30, 0.0]), lambda t: False)
    assert torch.isinf(total).all()
    total = Factored(left, right, torch.Size([2, 1])).batch_sum(torch.tensor([0.5, 0.0]), lambda t: False)
    assert torch.equal(total, torch.tensor([[0.5e10], [1e10]]))
    assert torch.isinf(left[1, 0, 0])  # not writable: untouched
