"""``noise_correlation='banded'`` through ``DPStrategy``: b = 1 is DP-SGD bit for bit, the released noise has the
covariance of ``sigma C s C^{-1} Z`` (BLT's too), the reported epsilon is the banded-mf accountant's, and
target_epsilon is met."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers import TinyRegressor, ZeroGradModule, example_user, make_trainer

from lightning_dp import DPStrategy
from lightning_dp.accounting.banded_mf import banded_mf_epsilon


def _fit(steps: int = 8, module: pl.LightningModule | None = None, callbacks=(), **options) -> DPStrategy:
    options.setdefault("noise_multiplier", 1.0)
    options.setdefault("seed", 0)
    strategy = DPStrategy(**options)
    torch.manual_seed(0)
    make_trainer(strategy, max_steps=steps, callbacks=list(callbacks)).fit(module or TinyRegressor(batch_size=4))
    return strategy


def _parameters(strategy: DPStrategy) -> list[torch.Tensor]:
    return [p.detach().clone() for p in strategy.lightning_module.parameters()]


def test_band_one_is_dp_sgd_bit_for_bit():
    dp_sgd = _fit()
    banded = _fit(noise_correlation="banded", correlation_band=1)
    for expected, got in zip(_parameters(dp_sgd), _parameters(banded), strict=True):
        assert torch.equal(expected, got)
    summary = banded.privacy_engine.summary()
    assert summary["epsilon"] == pytest.approx(dp_sgd.privacy_engine.epsilon(), rel=1e-9)  # pld, the Gaussian default
    assert summary["accountant"] == "banded-mf" and summary["participations"] == 8
    assert summary["max_column_norm"] == 1.0 and summary["group_sample_rate"] == summary["sample_rate"]


def test_reported_epsilon_is_the_banded_mf_accountants():
    strategy = _fit(steps=10, noise_correlation="banded", correlation_band=4)
    engine = strategy.privacy_engine
    plan, summary = engine.state.correlation, engine.summary()
    assert plan is not None and plan.band == 4 and summary["participations"] == 3  # ceil(10 / 4)
    expected = banded_mf_epsilon(
        plan.strategy,
        steps=10,
        noise_multiplier=1.0 * plan.column_norm,
        group_sample_rate=4 * engine.sample_rate,
        delta=engine.target_delta,
        num_groups=4,
    )
    assert engine.epsilon() == expected
    block = "\n".join(engine.startup_lines())
    for fact in ("banded-mf", "b = 4", "q_b = b q = 0.25", "k = ceil(n / b) = 3", f"s = {plan.column_norm:.4g}"):
        assert fact in block


def test_target_epsilon_is_met_from_below():
    strategy = _fit(steps=12, target_epsilon=2.0, noise_multiplier=None, noise_correlation="banded", correlation_band=3)
    epsilon = strategy.privacy_engine.epsilon()
    assert 2.0 * (1 - 1e-3) <= epsilon <= 2.0


class _Weights(pl.Callback):
    """The weight after each step (the first entry: before training)."""

    def __init__(self) -> None:
        self.weights: list[torch.Tensor] = []

    def on_train_start(self, trainer, module):
        self.weights.append(module.layer.weight.detach().clone())

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.weights.append(module.layer.weight.detach().clone())


@pytest.mark.parametrize(
    "options",
    [{"noise_correlation": "banded", "correlation_band": 3}, {"noise_correlation": "blt", "correlation_buffers": 2}],
    ids=["banded", "blt"],
)
def test_released_noise_has_the_covariance_of_the_strategy(options):
    """Zero gradients and SGD at lr 1: each update is ``-noise / (q N)``. The 100,000 weights are independent draws of
    the ``n``-step noise vector (over two seeds), whose covariance must be ``(sigma C_clip s)^2 C^{-1} C^{-T}``, ``s``
    the plan's scale (banded: the largest column norm; BLT: ``sens / sqrt(k)``, here b = floor(1 / 0.2) = 5)."""
    steps, sigma, clip = 6, 0.7, 2.0
    samples = []
    for seed in (0, 1):
        recorder = _Weights()
        strategy = DPStrategy(noise_multiplier=sigma, max_grad_norm=clip, seed=seed, **options)
        make_trainer(strategy, max_steps=steps, callbacks=[recorder]).fit(ZeroGradModule(batch_size=20))
        weights = torch.stack(recorder.weights).reshape(steps + 1, -1).double()
        expected_batch = strategy.privacy_engine.sample_rate * strategy.privacy_engine.num_samples
        samples.append(-(weights[1:] - weights[:-1]) * expected_batch)  # [steps, coordinates]
    noise = torch.cat(samples, dim=1).numpy()
    plan = strategy.privacy_engine.state.correlation
    inverse = plan.strategy.inverse_dense(steps)
    scale = (sigma * clip * plan.scale) ** 2
    empirical = noise @ noise.T / noise.shape[1]
    assert np.abs(empirical - scale * inverse @ inverse.T).max() < 0.03 * scale  # standard error ~0.005 scale
    assert not math.isclose(plan.scale, 1.0) and abs(inverse[1, 0]) > 0.05  # scaled, and correlated


@pytest.mark.parametrize(
    "options",
    [
        {"lowpass": "ema"},  # post-processing of the released noisy gradients
        {"secure_mode": True},  # Z_t from the hardened sampler, the generators reseeded from the OS
        {"privacy_unit": "user", "user_key": example_user, "sample_rate": 0.2},  # the groups are groups of users
        {"clipping_groups": "per_layer"},  # the sensitivity sqrt(sum_g C_g^2) scales the correlated noise
    ],
    ids=["lowpass", "secure_mode", "user_level", "clipping_groups"],
)
def test_composes_with(options):
    options = {"seed": None, **options} if options.get("secure_mode") else options
    strategy = _fit(steps=4, noise_correlation="banded", correlation_band=2, **options)
    summary = strategy.privacy_engine.summary()
    assert summary["participations"] == 2 and summary["accountant"] == "banded-mf"
    assert math.isfinite(summary["epsilon"])


@pytest.mark.parametrize("bad", [{"correlation_band": 8}, {"correlation_band": 40}])
def test_band_above_the_group_rate_or_the_steps_is_refused(bad):
    """q = 4/64: b = 8 makes q_b = 0.5 (accepted, but 8 > 4 planned steps); b = 40 makes q_b > 1."""
    match = "exceeds the 4 planned steps" if bad["correlation_band"] == 8 else r"group rate b\*q=2\.5 > 1"
    with pytest.raises(ValueError, match=match):
        _fit(steps=4, noise_correlation="banded", **bad)
