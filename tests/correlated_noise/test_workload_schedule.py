"""Correlated noise's strategy is optimised for the run's learning-rate schedule (Denisov et al. 2022: the workload
``A = P diag(eta) M``): the schedule is read before the first step from a copy of the scheduler on a stand-in
optimizer, equals the rates the trainers then apply (Lightning, per step and per epoch; the HF Trainer's own
scheduler and one given in ``optimizers=``), leaves the scheduler and optimizer untouched, and is left out, never
guessed, where it cannot be read (``ReduceLROnPlateau``, a scheduler that raises, groups on different schedules)."""

from __future__ import annotations

import functools
import logging
import math

import pytest
import torch
from helpers import TinyRegressor, make_trainer
from hf_helpers import make_trainer as make_hf_trainer
from hf_helpers import tiny_gpt2
from lightning.pytorch.callbacks import Callback
from transformers import TrainerCallback

from lightning_dp import DPStrategy
from lightning_dp.accounting.banded_mf import band_and_max_column_norm
from lightning_dp.correlated_noise import optimize_banded, strategy_error
from lightning_dp.correlated_noise.workloads import Workload
from lightning_dp.engine import workload as workload_module
from lightning_dp.engine.workload import scheduled_learning_rates, training_workload
from lightning_dp.hf import PrivacyArguments

lr_scheduler = torch.optim.lr_scheduler


def _optimizer(groups: int = 1) -> torch.optim.SGD:
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))], "lr": 0.1 * (g + 1)} for g in range(groups)]
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _applied(optimizer: torch.optim.Optimizer, scheduler, steps: int, every: int = 1) -> tuple[float, ...]:
    """The rates a training loop applies: the group's lr at each step, the scheduler stepped after every ``every``."""
    rates = []
    for step in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        if (step + 1) % every == 0:
            scheduler.step()
    return tuple(rates)


SCHEDULERS = {
    "linear-warmup": lambda opt: lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / 3, (12 - s) / 9)),
    "sequential": lambda opt: lr_scheduler.SequentialLR(
        opt, [lr_scheduler.LinearLR(opt, 0.2, total_iters=3), lr_scheduler.CosineAnnealingLR(opt, T_max=9)], [3]
    ),
    "one-cycle": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=12),
    "step": lambda opt: lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
}


@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_the_schedule_read_is_the_one_training_applies_and_nothing_moves(name, every):
    optimizer = _optimizer()
    scheduler = SCHEDULERS[name](optimizer)
    before = (scheduler.state_dict(), [dict(g, params=None) for g in optimizer.param_groups])
    rates = scheduled_learning_rates(scheduler, 12, steps_per_call=every)
    assert (scheduler.state_dict(), [dict(g, params=None) for g in optimizer.param_groups]) == before
    assert rates is not None and len(set(rates)) > 1
    assert rates == pytest.approx(_applied(optimizer, scheduler, 12, every), rel=1e-12, abs=1e-15)


def test_groups_on_proportional_schedules_are_read_and_on_different_ones_left_out():
    optimizer = _optimizer(groups=2)  # lr 0.1 and 0.2
    same = lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (s + 1))
    assert scheduled_learning_rates(same, 4) == pytest.approx((0.1, 0.05, 0.1 / 3, 0.025))
    different = lr_scheduler.LambdaLR(_optimizer(groups=2), [lambda s: 1 / (s + 1), lambda s: 1.0])
    assert scheduled_learning_rates(different, 4) is None


def test_a_schedule_that_cannot_be_read_is_left_out(caplog):
    assert scheduled_learning_rates(lr_scheduler.ReduceLROnPlateau(_optimizer()), 5) is None

    def fails(step: int) -> float:
        if step == 3:
            raise RuntimeError("boom")
        return 1.0 / (step + 1)

    with caplog.at_level(logging.INFO, logger="lightning_dp"):
        assert scheduled_learning_rates(lr_scheduler.LambdaLR(_optimizer(), fails), 6) is None
    assert "could not be read (boom): C is optimised for a constant rate" in caplog.text
    negative = lr_scheduler.LambdaLR(_optimizer(), lambda s: 1.0 - s)
    assert scheduled_learning_rates(negative, 4) is None


class _Decay(torch.nn.Module):
    """A module whose method is the lambda: a copy of the scheduler would copy its weight."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(512, 512))

    def rate(self, step: int) -> float:
        return 1.0 / (step + 1)

    def __call__(self, step: int) -> float:
        return self.rate(step)


class _CustomScheduler(lr_scheduler.LRScheduler):
    def get_lr(self) -> list[float]:
        return [base / (self.last_epoch + 1) for base in self.base_lrs]


@pytest.mark.parametrize("make", ["bound method", "callable module", "custom class", "partial of a module"])
def test_a_scheduler_whose_copy_could_hold_the_model_is_not_read(make, caplog, monkeypatch):
    """Only torch's schedulers over plain functions of the step (or partials of one over plain values) are copied:
    nothing of the model is deep-copied, and the schedule is left out (logged)."""
    decay = _Decay()
    scheduler = {
        "bound method": lambda opt: lr_scheduler.LambdaLR(opt, decay.rate),
        "callable module": lambda opt: lr_scheduler.LambdaLR(opt, decay),
        "custom class": _CustomScheduler,
        "partial of a module": lambda opt: lr_scheduler.LambdaLR(opt, functools.partial(_scaled, decay)),
    }[make](_optimizer())
    copied = []
    monkeypatch.setattr(torch.Tensor, "__deepcopy__", lambda self, memo: copied.append(self.shape))
    with caplog.at_level(logging.INFO, logger="lightning_dp"):
        assert scheduled_learning_rates(scheduler, 4) is None
    assert not copied and "is not read (torch's schedulers over functions of the step are)" in caplog.text


def _scaled(decay: _Decay, step: int) -> float:
    return decay.rate(step)


def test_the_workload_holds_the_momentum_and_the_schedule(caplog, monkeypatch):
    sgd = [_optimizer()]
    rates = (0.0, 0.5, 1.0, 0.5)  # a warm-up from 0
    assert training_workload(sgd, rates, 4) == Workload(4, 0.9, rates)
    assert training_workload(sgd, (0.1,) * 4, 4) == Workload(4, 0.9)  # one rate throughout: constant
    assert training_workload([torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])], None, 4) is None
    assert training_workload(sgd, rates, None) is None and training_workload(sgd, None, 0) is None
    with pytest.raises(ValueError, match="^3 learning rates for 4 planned steps$"):
        training_workload(sgd, rates[:3], 4)
    monkeypatch.setattr(workload_module, "MAX_SCHEDULED_STEPS", 3)
    with caplog.at_level(logging.INFO, logger="lightning_dp"):
        assert training_workload(sgd, rates, 4) == Workload(4, 0.9)
    assert "schedule of the 4 planned steps is not folded" in caplog.text


class _Rates(Callback):
    def __init__(self) -> None:
        self.rates: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.rates.append(trainer.optimizers[0].param_groups[0]["lr"])


class _DecayingRegressor(TinyRegressor):
    def __init__(self, interval: str) -> None:
        super().__init__(batch_size=8)  # 64 examples: 8 steps per epoch
        self.interval = interval

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        decay = lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + s))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": self.interval}}


@pytest.mark.parametrize("interval", ["step", "epoch"])
def test_lightning_optimises_c_for_the_schedule_it_then_applies(interval):
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, noise_correlation="banded", correlation_band=4)
    rates = _Rates()
    torch.manual_seed(0)
    make_trainer(strategy, max_steps=16, callbacks=[rates]).fit(_DecayingRegressor(interval))
    engine = strategy.privacy_engine
    plan = engine.state.correlation
    assert plan.workload is not None and plan.workload.learning_rates == pytest.approx(rates.rates, rel=1e-12)
    assert len(set(rates.rates)) == (16 if interval == "step" else 2)
    assert plan.strategy == optimize_banded(16, 4, max_participations=1, workload=plan.workload)
    prefix = optimize_banded(16, 4, max_participations=1)

    # at equal privacy (noise on C x scaled by the largest column norm), the error in the iterates is lower
    def error(strategy) -> float:
        return strategy_error(strategy, plan.workload) * band_and_max_column_norm(strategy, 16)[1] ** 2

    assert error(plan.strategy) < error(prefix)
    assert "optimised for the learning-rate schedule" in "\n".join(engine.startup_lines())


class _HFRates(TrainerCallback):
    def __init__(self) -> None:
        self.rates: list[float] = []

    def on_step_begin(self, args, state, control, optimizer=None, **kwargs):
        self.rates.append(optimizer.param_groups[0]["lr"])


def test_dp_trainer_runs_on_when_its_create_scheduler_raises_or_uses_another_optimizer(tmp_path, monkeypatch):
    """A user's create_scheduler that fails, or builds its scheduler on the real optimizer, leaves the schedule out
    (a constant rate); the Trainer's state is as before."""
    privacy = PrivacyArguments(noise_multiplier=1.0, dp_seed=0, noise_correlation="banded", correlation_band=2)
    trainer = make_hf_trainer(tiny_gpt2(), tmp_path, privacy=privacy, args=dict(max_steps=4))
    optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.1)

    def fails(num_training_steps, optimizer=None):
        raise RuntimeError("no schedule")

    monkeypatch.setattr(trainer, "create_scheduler", fails)
    assert trainer._planned_learning_rates(optimizer, 4) is None
    own = lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    monkeypatch.setattr(trainer, "create_scheduler", lambda num_training_steps, optimizer=None: own)
    assert trainer._planned_learning_rates(optimizer, 4) is None
    assert trainer.lr_scheduler is None


@pytest.mark.parametrize("given", [False, True], ids=["trainer's scheduler", "optimizers="])
def test_dp_trainer_optimises_c_for_the_schedule_it_then_applies(tmp_path, given):
    privacy = PrivacyArguments(noise_multiplier=1.0, dp_seed=0, noise_correlation="banded", correlation_band=2)
    args = dict(max_steps=6, lr_scheduler_type="linear", warmup_steps=2, optim="sgd", learning_rate=0.1)
    extra = {}
    if given:
        model = tiny_gpt2()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        extra = {"optimizers": (optimizer, lr_scheduler.LambdaLR(optimizer, lambda s: math.cos(s / 5)))}
    else:
        model = tiny_gpt2()
    trainer = make_hf_trainer(model, tmp_path, privacy=privacy, args=args, **extra)
    rates = _HFRates()
    trainer.add_callback(rates)
    trainer.train()
    plan = trainer.privacy_engine.state.correlation
    assert len(rates.rates) == 6 and len(set(rates.rates)) > 1
    assert plan.workload is not None and plan.workload.learning_rates == pytest.approx(rates.rates, rel=1e-12)
    assert plan.workload.momentum == (0.5 if given else 0.0)
    assert plan.strategy == optimize_banded(6, 2, max_participations=1, workload=plan.workload)
