"""``max_physical_batch_size`` on one process, both adapters: each Poisson micro-batch runs in passes of at most the
cap, the update (zero noise, and seeded noise: one draw per logical step) and the logged loss are the uncapped run's,
with gradient accumulation, empty batches, user-level sampling and resume; the start-up block shows the cap. Two
processes: test_physical_batch_cap_processes.py."""

from __future__ import annotations

import pytest
import torch
from helpers import USER_OPTIONS, TinyRegressor, ZeroGradModule, make_trainer
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_dp import DPStrategy, PrivacyAccountantCallback


class Regressor(TinyRegressor):
    """TinyRegressor recording the rows of every batch its step runs on with gradients (not the checks' replays)."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.sizes: list[int] = []

    def training_step(self, batch, batch_idx):
        if torch.is_grad_enabled():
            self.sizes.append(len(batch[0]))
        return super().training_step(batch, batch_idx)


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def _fit(cap: int | None, *, accumulate: int = 1, steps: int = 4, callbacks=(), precision="32-true", **options):
    torch.manual_seed(0)
    module = Regressor(batch_size=16 // accumulate)
    options = {"noise_multiplier": 0.0, "max_grad_norm": 0.5, "seed": 1, **options}
    strategy = DPStrategy(max_physical_batch_size=cap, **options)
    trainer = make_trainer(
        strategy, max_steps=steps, accumulate_grad_batches=accumulate, callbacks=list(callbacks), precision=precision
    )
    trainer.fit(module)
    assert strategy.privacy_engine.steps == steps
    return module, strategy


def _close(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_lightning_capped_update_equals_the_uncapped_one(accumulate, noise) -> None:
    cap = 3
    plain_losses, capped_losses = LossRecorder(), LossRecorder()
    plain, _ = _fit(None, accumulate=accumulate, noise_multiplier=noise, callbacks=[plain_losses])
    capped, strategy = _fit(cap, accumulate=accumulate, noise_multiplier=noise, callbacks=[capped_losses])
    _close(plain, capped)
    assert max(capped.sizes) <= cap < max(plain.sizes)
    assert sum(capped.sizes) == sum(plain.sizes)  # every example once, in passes of at most the cap
    assert capped_losses.losses == pytest.approx(plain_losses.losses, rel=1e-5)  # the mean over the micro-batch
    # the start-up block: the cap and the expected passes
    (line,) = [line for line in strategy.privacy_engine.startup_lines() if "physical batch cap" in line]
    assert "3 examples per forward/backward" in line and "pass(es) per logical step" in line


@pytest.mark.parametrize(
    "options",
    [
        {"momentum_length": 2},
        {"noise_multiplier": 1.0, "target_unclipped_quantile": 0.5},
        {"clipping_groups": "per_layer"},
    ],
    ids=["per-sample momentum", "adaptive clipping", "group-wise clipping"],
)
def test_lightning_cap_with_other_options_keeps_the_update(options) -> None:
    plain, _ = _fit(None, steps=3, **options)
    capped, _ = _fit(3, steps=3, **options)
    _close(plain, capped)


def test_lightning_noise_is_drawn_once_per_logical_step() -> None:
    draws = []

    class Counting(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            mechanism = trainer.strategy.privacy_engine.mechanism
            sample = type(mechanism).sample
            mechanism.sample = lambda like, generator: draws.append(1) or sample(mechanism, like, generator)

    _fit(2, accumulate=2, steps=3, noise_multiplier=1.0, callbacks=[Counting()])
    assert len(draws) == 3 * 4  # one draw per parameter tensor (4) per logical step


def test_lightning_empty_batches_take_noisy_steps_under_the_cap() -> None:
    module = ZeroGradModule(n=100, batch_size=10)
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.002, seed=1, max_physical_batch_size=2)
    make_trainer(strategy, max_steps=5).fit(module)
    assert strategy.privacy_engine.steps == 5
    assert module.layer.weight.abs().sum() > 0


def test_lightning_user_level_passes_split_users() -> None:
    plain, _ = _fit(None, accumulate=1, steps=3, **USER_OPTIONS)
    capped, _ = _fit(1, accumulate=1, steps=3, **USER_OPTIONS)
    _close(plain, capped)
    assert max(capped.sizes) <= USER_OPTIONS["examples_per_user"]  # one user's rows per pass


def _fit_with_checkpoints(path, max_epochs: int, cap: int | None, ckpt_path=None):
    torch.manual_seed(0)
    module = TinyRegressor()
    accountant = PrivacyAccountantCallback()
    strategy = DPStrategy(noise_multiplier=1.2, max_grad_norm=0.5, seed=3, max_physical_batch_size=cap)
    checkpoint = ModelCheckpoint(dirpath=path, every_n_epochs=1, save_top_k=-1)
    trainer = make_trainer(
        strategy, max_epochs=max_epochs, callbacks=[accountant, checkpoint], enable_checkpointing=True
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, accountant, strategy


def test_lightning_resume_under_the_cap_matches_the_uncapped_resume(tmp_path) -> None:
    _, full, _ = _fit_with_checkpoints(tmp_path / "full", 2, cap=2)
    results = {}
    for cap in (None, 2):
        _fit_with_checkpoints(tmp_path / f"part{cap}", 1, cap)
        (ckpt,) = list((tmp_path / f"part{cap}").iterdir())
        results[cap] = _fit_with_checkpoints(tmp_path / f"resumed{cap}", 2, cap, ckpt_path=ckpt)
    (plain, _, _), (capped, resumed, strategy) = results[None], results[2]
    _close(plain, capped)
    assert strategy.privacy_engine.steps == 2 * 8
    assert [e for _, _, e in resumed.history] == pytest.approx([e for _, _, e in full.history])


# ------------------------------------------------------------------------------------------------- DPTrainer
def _hf_fit(tmp_path, cap: int | None, *, args: dict, resume: str | None = None):
    from hf_helpers import TokenDataset, tiny_gpt2, trainable_snapshot, training_args

    from lightning_dp.hf import DPTrainer, PrivacyArguments

    class Recording(DPTrainer):
        def compute_per_example_loss(self, model, inputs):
            if torch.is_grad_enabled():
                self.sizes.append(len(inputs["input_ids"]))
            return super().compute_per_example_loss(model, inputs)

    model = tiny_gpt2()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):  # the same masks whatever the passes
            module.p = 0.0
    privacy = PrivacyArguments(
        noise_multiplier=1.0, per_sample_max_grad_norm=0.1, accountant="rdp", dp_seed=0, max_physical_batch_size=cap
    )
    trainer = Recording(
        model=model, args=training_args(tmp_path, **args), train_dataset=TokenDataset(n=32), privacy_args=privacy
    )
    trainer.sizes = []
    trainer.train(resume_from_checkpoint=resume)
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    return trainable_snapshot(model), trainer, losses


def test_dp_trainer_capped_update_and_loss_equal_the_uncapped_ones(tmp_path) -> None:
    pytest.importorskip("transformers")
    args = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=3)
    plain, plain_trainer, plain_losses = _hf_fit(tmp_path / "plain", None, args=args)
    capped, trainer, losses = _hf_fit(tmp_path / "capped", 2, args=args)
    for key in plain:
        torch.testing.assert_close(plain[key], capped[key], rtol=1e-5, atol=1e-6, msg=key)
    assert max(trainer.sizes) <= 2 < max(plain_trainer.sizes) and sum(trainer.sizes) == sum(plain_trainer.sizes)
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    assert trainer.privacy_engine.steps == 3 and trainer.get_epsilon() == plain_trainer.get_epsilon()


def test_dp_trainer_resume_under_the_cap_matches_the_uncapped_resume(tmp_path) -> None:
    pytest.importorskip("transformers")
    args = dict(per_device_train_batch_size=4, max_steps=4, save_strategy="steps", save_steps=2)
    results = {}
    for cap in (None, 2):
        out = tmp_path / str(cap)
        _hf_fit(out, cap, args=args)
        results[cap] = _hf_fit(out, cap, args=args, resume=str(out / "checkpoint-2"))
    (plain, plain_trainer, _), (capped, trainer, _) = results[None], results[2]
    for key in plain:
        torch.testing.assert_close(plain[key], capped[key], rtol=1e-5, atol=1e-6, msg=key)
    assert trainer.privacy_engine.steps == 4 and trainer.get_epsilon() == plain_trainer.get_epsilon()
    assert max(trainer.sizes) <= 2


def test_dp_trainer_empty_batches_under_the_cap(tmp_path) -> None:
    pytest.importorskip("transformers")
    from hf_helpers import make_trainer as make_hf_trainer
    from hf_helpers import tiny_gpt2

    from lightning_dp.hf import PrivacyArguments

    privacy = PrivacyArguments(noise_multiplier=1.0, dp_seed=0, sample_rate=0.02, max_physical_batch_size=1)
    trainer = make_hf_trainer(tiny_gpt2(), tmp_path, privacy=privacy, args=dict(max_steps=3))
    trainer.train()
    assert trainer.privacy_engine.steps == 3


@pytest.mark.parametrize("accumulate", [1, 2])
def test_lightning_cap_keeps_every_pass_of_16_bit_parameters(accumulate, monkeypatch) -> None:
    """bf16-true: the passes' float32 clipped sums (kept beside the bf16 .grad) survive Lightning's zero_grad."""
    from lightning_dp.optim import dp_optimizer

    taken: list[list[torch.Tensor]] = []
    take = dp_optimizer.take_float32_sums
    monkeypatch.setattr(
        dp_optimizer,
        "take_float32_sums",
        lambda params: taken.append(take(params)) or taken[-1],  # type: ignore[func-returns-value]
    )
    sums = []
    for cap in (None, 3):
        taken.clear()
        _fit(cap, accumulate=accumulate, steps=2, precision="bf16-true")
        sums.append([t for step in taken for t in step])
    for plain, capped in zip(*sums, strict=True):
        torch.testing.assert_close(capped, plain, rtol=1e-5, atol=1e-6)
