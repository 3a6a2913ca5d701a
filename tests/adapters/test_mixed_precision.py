"""float16 and bfloat16 training through both adapters on CPU (docs/privacy.md, "Mixed precision").

Lightning ``precision="16-mixed"`` falls back to bf16 on CPU, so the float16 runs pass Lightning's ``MixedPrecision``
plugin with a CPU ``GradScaler``; accelerate sets up neither autocast nor a scaler for ``fp16=True`` on CPU, so the HF
runs give the Accelerator both, as it does on a GPU. An example whose gradient overflows float16 at the clipper's loss
scale is dropped: the step is still taken and recorded, and the scaler's scale does not back off.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from helpers import TinyRegressor, make_trainer  # noqa: E402
from hf_helpers import TokenDataset, tiny_gpt2, trainable_snapshot, training_args  # noqa: E402
from hf_helpers import make_trainer as make_hf_trainer  # noqa: E402
from lightning.pytorch.plugins import MixedPrecision  # noqa: E402
from lightning.pytorch.plugins.precision.fsdp import FSDPPrecision  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_dp import DPStrategy  # noqa: E402
from lightning_dp.clipping.loss_scaling import FP16_LOSS_SCALE  # noqa: E402
from lightning_dp.engine.grad_scaler import MAX_GRAD_SCALE, hand_to_grad_scaler  # noqa: E402
from lightning_dp.hf import DPTrainer, PrivacyArguments  # noqa: E402
from lightning_dp.hf.callbacks import PrivacyBudget as HFPrivacyBudget  # noqa: E402
from lightning_dp.lightning.callbacks import PrivacyBudget  # noqa: E402

STEPS = 3
INIT_SCALE = 2.0**16


def _fp16_plugin() -> MixedPrecision:
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=INIT_SCALE))


class _Temperature(pl.LightningModule):
    """``t_i * sum(net(x_i))`` in float32 from the float16 output: a finite loss, but ``t = 1e4`` makes the output
    gradient ``256 t`` overflow float16 at the clipper's scale, for the examples marked so in the data."""

    def __init__(self, n: int = 16, hot: tuple[int, ...] = (3,)) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        temperature = torch.ones(n)
        temperature[list(hot)] = 1e4
        self.data = TensorDataset(torch.randn(n, 4), temperature)

    def training_step(self, batch, batch_idx):
        x, t = batch
        return self.net(x).float().squeeze(-1) * t

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=len(self.data) // 2)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _recording_clippers(engine) -> list:
    """The clippers ``engine.start_run`` attaches, in order (read after the run: teardown detaches them)."""
    clippers = []
    start_run = engine.start_run

    def recording(*args, **kwargs):
        start_run(*args, **kwargs)
        clippers.append(engine.state.clipper)

    engine.start_run = recording
    return clippers


def _params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def test_lightning_16_mixed_steps_with_finite_updates_and_the_clippers_scale() -> None:
    module = TinyRegressor()
    before = _params(module)
    strategy = DPStrategy(noise_multiplier=0.5, max_grad_norm=1.0, seed=0)
    dtypes = _dtype_recorder(module)
    trainer = make_trainer(strategy, max_steps=STEPS, plugins=[_fp16_plugin()])
    clippers = _recording_clippers(strategy.privacy_engine)
    trainer.fit(module)
    assert clippers[0].loss_scale == FP16_LOSS_SCALE and not clippers[0].dropped_nonfinite
    after = _params(module)
    assert torch.float16 in dtypes
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert trainer.global_step == STEPS and strategy.privacy_engine.steps == STEPS
    scaler = trainer.precision_plugin.scaler
    assert scaler.get_scale() == INIT_SCALE  # no overflow seen: no back-off (growth only every 2000 steps)


class _SkipsOne(TinyRegressor):
    """Returns None for batch 1 (the user skips it)."""

    def training_step(self, batch, batch_idx):
        return None if batch_idx == 1 else super().training_step(batch, batch_idx)


def test_lightning_16_mixed_records_a_skipped_batch_as_without_a_scaler() -> None:
    """A step whose training_step returned None is noised, taken and recorded under 16-mixed as under 32-true (the
    scaler's plugin alone would skip it after its gradient was noised)."""
    steps = []
    for plugins in ([], [_fp16_plugin()]):
        strategy = DPStrategy(noise_multiplier=0.5, max_grad_norm=1.0, seed=0)
        trainer = make_trainer(strategy, max_steps=STEPS, plugins=plugins)
        trainer.fit(_SkipsOne())
        steps.append((trainer.global_step, strategy.privacy_engine.steps))
    assert steps[0] == steps[1] == (STEPS, STEPS)


def _fsdp_fp16_plugin() -> FSDPPrecision:
    plugin = FSDPPrecision("16-mixed")
    plugin.scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)  # it makes a ShardedGradScaler, CUDA only
    return plugin


@pytest.mark.parametrize("plugin", [_fp16_plugin, _fsdp_fp16_plugin])
@pytest.mark.parametrize("budget", [0.01, 0.6])
def test_lightning_16_mixed_stops_at_a_spent_budget_as_without_a_scaler(plugin, budget: float) -> None:
    """Once the budget is spent the optimizer takes no step and nothing is noised; the scaler's step gets zero
    gradients to unscale (with none it raised "No inf checks were recorded" or "_scale is None", found in review) and
    the optimizer skips it. ``min_steps`` keeps Lightning calling the training step past the stop."""
    steps = []
    for plugins in ([], [plugin()]):
        strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
        callbacks = [PrivacyBudget(budget)]
        trainer = make_trainer(strategy, max_steps=8, min_steps=8, plugins=plugins, callbacks=callbacks)
        trainer.fit(TinyRegressor())
        steps.append((trainer.global_step, strategy.privacy_engine.steps))
    assert steps[0] == steps[1] and steps[0][1] < 8


class _NaNAtStep(pl.Callback):
    """Writes NaN into a clipped sum after the backward at ``step`` (a hook writing ``p.grad``, as a bug would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_after_backward(self, trainer, module):
        if trainer.global_step == self.step:
            next(module.parameters()).grad[0, 0] = float("nan")


def test_lightning_16_mixed_raises_on_a_nonfinite_clipped_sum_before_its_noise_at_any_step() -> None:
    """Without a scaler the finite check is read at the first step and every 100th, and a non-finite sum at another
    step makes the model NaN until the next read raises; the scaler would skip such a step and halve its scale
    instead (found in review). Under a scaler the check is read at every step: the step raises before its noise, the
    scale untouched."""
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    plugin = _fp16_plugin()
    trainer = make_trainer(strategy, max_steps=6, plugins=[plugin], callbacks=[_NaNAtStep(2)])
    with pytest.raises(FloatingPointError, match="is not finite before the noise is added"):
        trainer.fit(TinyRegressor())
    assert strategy.privacy_engine.steps == 2 and plugin.scaler.get_scale() == INIT_SCALE


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_lightning_bf16_runs_with_finite_updates(precision: str) -> None:
    module = TinyRegressor()
    before = _params(module)
    strategy = DPStrategy(noise_multiplier=0.5, max_grad_norm=1.0, seed=0)
    trainer = make_trainer(strategy, max_steps=STEPS, precision=precision)
    trainer.fit(module)
    after = _params(module)
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert strategy.privacy_engine.steps == STEPS


def test_lightning_an_overflowing_example_is_dropped_and_the_step_taken() -> None:
    """Every step samples from 16 examples at rate 1/2; example 3 overflows float16 at the clipper's scale. The
    steps are all taken and recorded, the scaler's scale stays put, and the drop is reported."""
    module = _Temperature()
    before = _params(module)
    strategy = DPStrategy(noise_multiplier=0.5, max_grad_norm=1.0, seed=3)
    trainer = make_trainer(strategy, max_steps=STEPS, plugins=[_fp16_plugin()])
    clippers = _recording_clippers(strategy.privacy_engine)
    trainer.fit(module)
    engine = strategy.privacy_engine
    assert clippers[0].dropped_nonfinite
    assert trainer.global_step == STEPS and engine.steps == STEPS
    assert trainer.precision_plugin.scaler.get_scale() == INIT_SCALE
    after = _params(module)
    assert all(torch.isfinite(p).all() for p in after)
    assert all(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_hand_to_grad_scaler_gives_the_noised_gradient_back() -> None:
    """unscale_ of the scaled gradient is the gradient exactly (powers of two); a huge one is clamped, not inf."""
    param = nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    noised = torch.tensor([0.25, -3.0, 1e35])
    param.grad = noised.clone()
    hand_to_grad_scaler([param], scaler)
    assert torch.isfinite(param.grad).all()
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert torch.equal(param.detach()[:2], -noised[:2])  # stepped: no inf found
    assert scaler.get_scale() == INIT_SCALE


def test_the_grad_scalers_scale_stops_growing_at_the_cap() -> None:
    """A scaler that never finds an overflow doubles its scale forever; handed the gradient, it stays at the cap, so
    that unscale_ never divides by infinity (which would zero every gradient)."""
    param = nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, growth_interval=1)
    for _ in range(3):
        param.grad = torch.tensor([0.5, -2.0])
        hand_to_grad_scaler([param], scaler)
        scaler.unscale_(optimizer)
        torch.testing.assert_close(param.grad, torch.tensor([0.5, -2.0]))
        scaler.step(optimizer)
        scaler.update()
        assert scaler.get_scale() <= 2 * MAX_GRAD_SCALE


def _hf_fp16(trainer) -> torch.amp.GradScaler:
    """What accelerate sets up for fp16 on a GPU (it sets up nothing on CPU): autocast in the prepared model's forward
    and a GradScaler around the optimizer."""
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    trainer.accelerator.native_amp = True
    trainer.accelerator.scaler = scaler
    return scaler


def _dtype_recorder(model: nn.Module) -> set[torch.dtype]:
    dtypes: set[torch.dtype] = set()
    first = next(m for m in model.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D")
    first.register_forward_hook(lambda module, args, out: dtypes.add(out.dtype))
    return dtypes


def test_hf_trainer_fp16_stops_at_a_spent_budget_as_without_a_scaler(tmp_path) -> None:
    """A step past the budget noises nothing and the optimizer skips it, but accelerate's scaler step still runs: the
    gradients are zeros for it to unscale (without them it raised "Attempted unscale_ but _scale is None", found in
    review), and no step is recorded."""
    runs = []
    for fp16 in (False, True):
        privacy = PrivacyArguments(noise_multiplier=1.0, accountant="rdp", dp_seed=0)
        trainer = make_hf_trainer(
            tiny_gpt2(), tmp_path / str(fp16), TokenDataset(), privacy=privacy, callbacks=[HFPrivacyBudget(0.01)],
            args={"fp16": True} if fp16 else {},
        )  # fmt: skip
        if fp16:
            _hf_fp16(trainer)
        trainer.train()
        runs.append((trainer.state.global_step, trainer.privacy_engine.steps))
    assert runs[0] == runs[1] == (1, 0)


class _NaNAtStep2(DPTrainer):
    """Writes NaN into the head's clipped sum during the step after two (a hook writing ``p.grad``, as a bug would)."""

    def compute_per_example_loss(self, model, inputs):
        if self.state.global_step == 2:
            model.lm_head.weight.grad = torch.full_like(model.lm_head.weight, float("nan"))
        return super().compute_per_example_loss(model, inputs)


def test_hf_trainer_fp16_raises_on_a_nonfinite_clipped_sum_before_its_noise_at_any_step(tmp_path) -> None:
    """As under Lightning: with accelerate's scaler the finite check is read at every step, so the third step raises
    before its noise (without a scaler that step's update makes the model NaN until the next read)."""
    privacy = PrivacyArguments(noise_multiplier=1.0, accountant="rdp", dp_seed=0)
    args = training_args(tmp_path, max_steps=5, fp16=True)
    trainer = _NaNAtStep2(model=tiny_gpt2(), args=args, train_dataset=TokenDataset(), privacy_args=privacy)
    scaler = _hf_fp16(trainer)
    with pytest.raises(FloatingPointError, match="is not finite before the noise is added"):
        trainer.train()
    assert trainer.privacy_engine.steps == 2 and scaler.get_scale() == INIT_SCALE


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_hf_trainer_mixed_precision_steps(tmp_path, precision: str) -> None:
    model = tiny_gpt2()
    before = trainable_snapshot(model)
    dtypes = _dtype_recorder(model)
    privacy = PrivacyArguments(noise_multiplier=0.5, accountant="rdp", dp_seed=0)
    trainer = make_hf_trainer(model, tmp_path, TokenDataset(), privacy=privacy, args={precision: True})
    scaler = _hf_fp16(trainer) if precision == "fp16" else None
    clippers = _recording_clippers(trainer.privacy_engine)
    trainer.train()
    after = trainable_snapshot(model)
    assert {torch.float16 if precision == "fp16" else torch.bfloat16} <= dtypes
    assert trainer.state.global_step == STEPS and trainer.privacy_engine.steps == STEPS
    assert all(torch.isfinite(p).all() for p in after.values())
    assert any(not torch.equal(before[n], after[n]) for n in before)
    assert clippers[0].loss_scale == (FP16_LOSS_SCALE if precision == "fp16" else 1.0)
    if scaler is not None:
        assert scaler.get_scale() == INIT_SCALE and not trainer.accelerator.optimizer_step_was_skipped
