"""``noise_correlation='blt'`` through ``DPStrategy`` and ``DPTrainer``: the sampler's ``b = floor(1 / q)`` groups
(every step from group ``t mod b``), epsilon
equal to the analytic Gaussian mechanism of ``k`` unamplified steps at the noise multiplier (the scaling
``s = sens / sqrt(k)``), the target met from below, and a resume as a new segment with no noise state in the
checkpoint."""

from __future__ import annotations

import json
import math

import lightning.pytorch as pl
import pytest
import torch
from correlation_helpers import analytic_gaussian_epsilon, brute_force_sensitivity
from helpers import TinyRegressor, make_trainer, regression_data
from hf_helpers import make_trainer as make_hf_trainer
from hf_helpers import tiny_gpt2
from torch import nn
from torch.utils.data import TensorDataset

from lightning_dp import DPStrategy, PrivacyEngine
from lightning_dp.engine.correlation import BLTPlan
from lightning_dp.hf import PrivacyArguments
from lightning_dp.hf.callbacks import PRIVACY_STATE_NAME

BLT = dict(noise_correlation="blt", correlation_buffers=2)


class _Groups(pl.Callback):
    """Checks that the batch of every optimizer step comes from group ``step mod b`` (the first input column of the
    data is the example's index) and counts the steps seen."""

    def __init__(self) -> None:
        self.steps_seen = 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        sampler = trainer.train_dataloader.batch_sampler
        indices = batch[0][:, 0].round().long()
        assert set(sampler.groups[indices].tolist()) <= {trainer.global_step % sampler.num_groups}
        self.steps_seen += 1


def _fit(steps: int, ckpt_path=None, **options) -> tuple[pl.Trainer, DPStrategy]:
    x, y = regression_data().tensors  # 64 examples, batch 4: q = 1/16, b = 16
    x[:, 0] = torch.arange(len(x), dtype=x.dtype)
    strategy = DPStrategy(**{"noise_multiplier": 1.0, "seed": 0, **BLT, **options})
    torch.manual_seed(0)
    groups = _Groups()
    trainer = make_trainer(strategy, max_steps=steps, callbacks=[groups])
    trainer.fit(TinyRegressor(batch_size=4, data=TensorDataset(x, y)), ckpt_path=ckpt_path)
    assert groups.steps_seen > 0 and strategy.privacy_engine.steps == steps
    return trainer, strategy


def _plan(strategy: DPStrategy) -> BLTPlan:
    plan = strategy.privacy_engine.state.correlation
    assert isinstance(plan, BLTPlan)
    return plan


def test_epsilon_is_k_unamplified_gaussian_steps_and_the_sensitivity_is_exact():
    """n = 40 steps at q = 1/16: b = 16, k = 3, so epsilon is the Gaussian mechanism with mu = sqrt(3) / sigma."""
    _, strategy = _fit(40, noise_multiplier=1.5)
    engine, plan = strategy.privacy_engine, _plan(strategy)
    assert (plan.num_groups, plan.participations, plan.strategy.num_buffers) == (16, 3, 2)
    assert plan.sensitivity == pytest.approx(brute_force_sensitivity(plan.strategy, 40, 16))
    expected = analytic_gaussian_epsilon(math.sqrt(3) / 1.5, engine.target_delta)
    assert expected * (1 - 1e-9) <= engine.epsilon() <= expected * (1 + 2e-3)
    summary = engine.summary()
    assert summary["accountant"] == "blt-minsep" and summary["participations"] == 3
    assert summary["noise_correlation"] == "blt" and summary["num_groups"] == 16 and summary["correlation_buffers"] == 2
    block = "\n".join(engine.startup_lines())
    for fact in ("blt-minsep", "d = 2 buffers", "b = floor(1 / q) = 16", "k = ceil(n / b) = 3", "no amplification"):
        assert fact in block


def test_target_epsilon_is_met_from_below_with_the_default_buffers():
    _, strategy = _fit(24, noise_multiplier=None, target_epsilon=4.0, correlation_buffers=None)
    engine = strategy.privacy_engine
    assert 4.0 * (1 - 1e-3) <= engine.epsilon() <= 4.0
    assert _plan(strategy).strategy.num_buffers == 4
    assert "correlation_buffers = 4 (noise_correlation='blt')" in "\n".join(engine.startup_lines())


def test_resume_is_a_new_segment_and_the_checkpoint_holds_no_noise(tmp_path):
    trainer, first = _fit(20)
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    checkpoint = torch.load(tmp_path / "m.ckpt", weights_only=False)
    plan = _plan(first)
    assert checkpoint["lightning_dp"]["noise_correlation"] == {
        "kind": "blt",
        "decays": list(plan.strategy.decays),
        "scales": list(plan.strategy.scales),
        "noise_scale": plan.scale,
    }
    (optimizer,) = first.privacy_engine._optimizers
    state = [t for vector in optimizer.correlation.state_dict()["state"] for t in vector]
    saved = [t for t in checkpoint["state_dict"].values()] + [
        t for s in checkpoint["optimizer_states"] for v in s["state"].values() for t in v.values() if torch.is_tensor(t)
    ]
    assert state and not any(s.shape == t.shape and torch.equal(s, t) for s in state for t in saved)

    _, resumed = _fit(36, ckpt_path=tmp_path / "m.ckpt")
    engine = resumed.privacy_engine
    assert [(event.segment, count) for event, count in engine.accountant.ledger] == [(0, 20), (1, 16)]
    assert _plan(resumed).strategy == plan.strategy and engine.accountant.participations == 2 + 1
    sens = math.hypot(brute_force_sensitivity(plan.strategy, 20, 16), brute_force_sensitivity(plan.strategy, 16, 16))
    expected = analytic_gaussian_epsilon(sens / (1.0 * plan.scale), engine.target_delta)
    assert expected * (1 - 1e-9) <= engine.epsilon() <= expected * (1 + 2e-3)
    assert "segment 1 (the correlation restarted)" in "\n".join(engine.startup_lines())
    assert engine.summary()["sensitivity"] == pytest.approx(sens) and engine.summary()["noise_scale"] == plan.scale


def test_a_banded_checkpoint_does_not_resume_blt(tmp_path):
    strategy = DPStrategy(noise_multiplier=1.0, noise_correlation="banded", correlation_band=2, seed=0)
    trainer = make_trainer(strategy, max_steps=2)
    trainer.fit(TinyRegressor(batch_size=4))
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    with pytest.raises(ValueError, match="trained with noise_correlation='banded': resume with the same"):
        _fit(4, ckpt_path=tmp_path / "m.ckpt")


def test_dp_trainer_trains_blt_and_checkpoints_its_strategy(tmp_path):
    privacy = PrivacyArguments(noise_multiplier=1.0, dp_seed=0, check_batch_independence=False, **BLT)
    args = dict(max_steps=4, per_device_train_batch_size=8, save_strategy="steps", save_steps=2, logging_steps=100)
    trainer = make_hf_trainer(tiny_gpt2(), tmp_path, privacy=privacy, args=args)
    trainer.train()
    engine = trainer.privacy_engine
    plan = engine.state.correlation
    assert isinstance(plan, BLTPlan) and engine.accountant.name == "blt-minsep" and plan.num_groups == 4  # q = 8/32
    assert engine.epsilon() == plan.epsilon(1.0, engine.target_delta)
    state = json.loads((tmp_path / "checkpoint-2" / PRIVACY_STATE_NAME).read_text())
    assert state["noise_correlation"]["kind"] == "blt"


def test_the_low_level_api_needs_the_cyclic_sampler_first():
    """``PrivacyEngine.prepare`` without ``training_loader`` would account a pattern no sampler enforces: refused."""
    engine = PrivacyEngine(noise_multiplier=1.0, noise_correlation="blt", correlation_buffers=2)
    engine.start_run(nn.Linear(3, 1), None)
    with pytest.raises(RuntimeError, match=r"cyclic sampler: build the training loader with training_loader\(\)"):
        engine.prepare(num_samples=1000, sample_rate=0.01, total_steps=200)


def test_fewer_planned_steps_than_groups_are_refused():
    """q = 1/16 gives b = 16 groups: 8 planned steps would never sample half of the data."""
    with pytest.raises(ValueError, match=r"once every b = floor\(1 / q\) = 16 steps, more than the 8 planned"):
        _fit(8)


def test_one_group_is_warned_about(caplog):
    """q = 3/4 gives b = 1: every step may use every example, with no amplification credited."""
    x, y = regression_data().tensors
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, sample_rate=0.75, **BLT)
    with caplog.at_level("WARNING", logger="lightning_dp"):
        make_trainer(strategy, max_steps=3).fit(TinyRegressor(batch_size=48, data=TensorDataset(x, y)))
    assert "has one cyclic group (b = 1)" in caplog.text and _plan(strategy).num_groups == 1
