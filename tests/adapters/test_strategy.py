"""DPStrategy end to end on tiny models: equivalence without noise, noise scale, accumulation, resume, errors."""

import math

import pytest
import torch
from helpers import ClassifierWith, TinyRegressor, ZeroGradModule, make_trainer
from lightning.pytorch.callbacks import BatchSizeFinder, Callback, LearningRateFinder, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.tuner import Tuner
from torch import nn

from lightning_dp import DPStrategy, PrivacyAccountantCallback, PrivacyBudget, PrivacyEngine
from lightning_dp.clipping import ENGINES


def _params(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("clipping", ["flat", "ghost"])
def test_without_noise_and_clipping_equals_plain_training(clipping):
    torch.manual_seed(0)
    plain = TinyRegressor(per_sample=False)
    private = TinyRegressor(per_sample=True)
    private.load_state_dict(plain.state_dict())
    make_trainer("auto", max_steps=6).fit(plain)
    strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=1e6, clipping=clipping, poisson_sampling=False)
    make_trainer(strategy, max_steps=6).fit(private)
    for a, b in zip(_params(plain), _params(private), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_accumulation_equals_large_batch_and_noise_once_per_logical_step():
    torch.manual_seed(0)
    big = TinyRegressor(batch_size=16)
    small = TinyRegressor(batch_size=8)
    small.load_state_dict(big.state_dict())
    s_big = DPStrategy(noise_multiplier=0.0, max_grad_norm=0.5, poisson_sampling=False)
    make_trainer(s_big, max_steps=4).fit(big)
    s_small = DPStrategy(noise_multiplier=0.0, max_grad_norm=0.5, poisson_sampling=False)
    make_trainer(s_small, max_steps=4, accumulate_grad_batches=2).fit(small)
    for a, b in zip(_params(big), _params(small), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert s_big.privacy_engine.steps == s_small.privacy_engine.steps == 4


def test_noise_std_on_zero_gradient():
    module = ZeroGradModule()
    sigma, clip = 1.3, 0.7
    strategy = DPStrategy(noise_multiplier=sigma, max_grad_norm=clip, seed=5)
    make_trainer(strategy, max_steps=1).fit(module)
    expected_batch = strategy.sample_rate * 100
    update = module.layer.weight.detach().flatten()  # -lr * noise / (q N), lr = 1
    assert update.std().item() == pytest.approx(sigma * clip / expected_batch, rel=0.05)
    assert abs(update.mean().item()) < 0.05 * sigma * clip / expected_batch


def test_noise_is_reproducible_from_seed_and_leaves_global_rng_alone():
    results = []
    for _ in range(2):
        module = ZeroGradModule()
        make_trainer(DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=11), max_steps=2).fit(module)
        results.append(module.layer.weight.detach().clone())
    torch.testing.assert_close(results[0], results[1])


def test_epsilon_logged_each_epoch_and_summary(tmp_path):
    callback = PrivacyAccountantCallback()
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    logger = CSVLogger(tmp_path)
    trainer = make_trainer(strategy, max_epochs=3, callbacks=[callback], logger=logger, enable_progress_bar=True)
    trainer.fit(TinyRegressor())
    epsilons = [eps for _, _, eps in callback.history]
    assert len(epsilons) == 3 and epsilons[0] < epsilons[1] < epsilons[2]
    assert "epsilon" in trainer.progress_bar_metrics
    assert callback.summary["epsilon"] == pytest.approx(epsilons[-1])
    assert callback.summary["steps"] == 3 * math.ceil(64 / 8)
    assert callback.summary["sample_rate"] == pytest.approx(8 / 64)
    assert callback.summary["noise_multiplier"] == 1.0 and callback.summary["accountant"] == "pld"
    # the calls users make on the strategy (Opacus's name), the same numbers as the accountant's
    accountant = strategy.privacy_engine.accountant
    delta = strategy.privacy_engine.target_delta
    assert strategy.get_epsilon() == accountant.get_epsilon(delta) == callback.summary["epsilon"]
    assert strategy.get_epsilon(delta / 10) == accountant.get_epsilon(delta / 10) > strategy.get_epsilon()
    assert strategy.privacy_summary() == callback.summary
    logger.save()
    metrics = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "epsilon" in metrics and "dp/epsilon" in metrics


def test_privacy_summary_before_training_says_there_is_none_yet():
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0)
    assert strategy.get_epsilon() == 0.0
    with pytest.raises(RuntimeError, match="once training has started"):
        strategy.privacy_summary()


def test_hooks_detached_and_state_dict_unchanged_after_fit():
    module = TinyRegressor()
    keys = list(module.state_dict())
    make_trainer(DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_steps=2).fit(module)
    assert list(module.state_dict()) == keys
    for sub in module.modules():
        assert not sub._forward_hooks and not sub._forward_pre_hooks and not sub._backward_hooks


def test_lr_scheduler_keeps_working():
    module = TinyRegressor(scheduler=True)
    trainer = make_trainer(DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_epochs=2)
    trainer.fit(module)
    assert trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0] == pytest.approx(0.1 * 0.25)


def test_bf16_autocast_runs_with_finite_updates():
    module = TinyRegressor()
    before = _params(module)
    strategy = DPStrategy(noise_multiplier=0.5, max_grad_norm=1.0, clipping="ghost")
    make_trainer(strategy, max_steps=3, precision="bf16-mixed").fit(module)
    after = _params(module)
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def _fit_with_checkpoints(tmp_path, max_epochs, ckpt_path=None, clipping="auto"):
    callback = PrivacyAccountantCallback()
    strategy = DPStrategy(noise_multiplier=1.2, max_grad_norm=1.0, seed=3, clipping=clipping)
    checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_epochs=1, save_top_k=-1)
    trainer = make_trainer(strategy, max_epochs=max_epochs, callbacks=[callback, checkpoint], enable_checkpointing=True)
    trainer.fit(TinyRegressor(), ckpt_path=ckpt_path)
    return callback, strategy


def test_resume_continues_the_epsilon_curve(tmp_path):
    full, _ = _fit_with_checkpoints(tmp_path / "full", 4)
    _fit_with_checkpoints(tmp_path / "part", 2)
    (ckpt,) = [p for p in (tmp_path / "part").iterdir() if "epoch=1" in p.name]
    checkpoint = torch.load(ckpt, weights_only=False)
    assert checkpoint["lightning_dp"]["accountant"]["ledger"][0][1] == 2 * 8
    resumed, strategy = _fit_with_checkpoints(tmp_path / "resumed", 4, ckpt_path=ckpt)
    assert strategy.privacy_engine.steps == 4 * 8
    assert [e for _, _, e in resumed.history] == pytest.approx([e for _, _, e in full.history])


@pytest.mark.parametrize("saved_with", ["flat", "auto"])
def test_a_checkpoint_of_any_exact_engine_resumes_under_auto(tmp_path, saved_with):
    """The privacy state names no engine (every exact engine gives the same clipped sum, and a randomized one's
    events are in the ledger), so a checkpoint written with clipping='flat' (the default before 'auto') or 'auto'
    resumes under the default 'auto', resolved for this run, on the same epsilon curve."""
    full, _ = _fit_with_checkpoints(tmp_path / "full", 3)
    _fit_with_checkpoints(tmp_path / "part", 1, clipping=saved_with)
    (ckpt,) = list((tmp_path / "part").iterdir())
    resumed, strategy = _fit_with_checkpoints(tmp_path / "resumed", 3, ckpt_path=ckpt)
    assert strategy.privacy_engine.clipping == "mixed" and resumed.summary["clipping"] == "mixed"
    assert strategy.privacy_engine.steps == 3 * 8
    assert [e for _, _, e in resumed.history] == pytest.approx([e for _, _, e in full.history])


def test_budget_guard_stops_before_exceeding():
    budget = PrivacyBudget(target_epsilon=2.0)
    strategy = DPStrategy(noise_multiplier=0.8, max_grad_norm=1.0, seed=0)
    trainer = make_trainer(strategy, max_epochs=50, callbacks=[budget])
    trainer.fit(TinyRegressor())
    engine = strategy.privacy_engine
    assert 0 < engine.steps < 50 * 8 and budget.stopped_at_step == engine.steps
    assert trainer.global_step == engine.steps  # no skipped step counted by Lightning
    assert engine.epsilon() <= 2.0
    one_more = engine.accountant.copy().compose(engine.step_event()).get_epsilon(engine.target_delta)
    assert one_more > 2.0


# ------------------------------------------------------------------------------------------------ errors
def test_batchnorm_fails_before_training():
    body = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    with pytest.raises(ValueError, match=r"BatchNorm.*GroupNorm|GroupNorm.*BatchNorm"):
        make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=1).fit(ClassifierWith(body))


class _RawParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(6))

    def forward(self, x):
        return (x * self.scale).sum(-1, keepdim=True)


@pytest.mark.parametrize("clipping", ENGINES)
def test_a_module_of_its_own_parameters_trains_through_the_exact_fallback(clipping):
    model = ClassifierWith(_RawParameter())
    before = model.body.scale.detach().clone()
    strategy = DPStrategy(noise_multiplier=1.0, clipping=clipping, seed=0)
    make_trainer(strategy, max_steps=2).fit(model)
    assert strategy.privacy_engine.steps == 2 and not torch.equal(model.body.scale, before)


def test_frozen_unsupported_layer_is_fine():
    body = _RawParameter()
    body.scale.requires_grad_(False)
    model = ClassifierWith(nn.Sequential(nn.Linear(6, 6), body))
    make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=1).fit(model)


def test_mean_loss_is_rejected_with_advice():
    with pytest.raises(ValueError, match=r"per-sample loss of shape \[B\]"):
        make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=1).fit(TinyRegressor(per_sample=False))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target_epsilon": 0.0}, "epsilon must be positive"),
        ({"target_epsilon": -1.0}, "epsilon must be positive"),
        ({"target_epsilon": 1.0, "target_delta": 0.0}, "delta"),
        ({"target_epsilon": 1.0, "target_delta": 1.0}, "delta"),
        ({"noise_multiplier": 1.0, "max_grad_norm": 0.0}, "max_grad_norm"),
        ({"noise_multiplier": 1.0, "max_grad_norm": -1.0}, "max_grad_norm"),
        ({"noise_multiplier": 1.0, "target_epsilon": 1.0}, "exactly one"),
        ({}, "exactly one"),
        ({"noise_multiplier": -0.5}, "noise_multiplier"),
        ({"noise_multiplier": 1.0, "sample_rate": 1.5}, "sample_rate"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DPStrategy(**kwargs)


def test_fp16_parameters_and_gradient_clipping_are_rejected():
    """float16 parameters ("16-true") are refused; float16 autocast ("16-mixed") runs: test_mixed_precision.py."""
    with pytest.raises(ValueError, match="16-mixed"):
        make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=1, precision="16-true").fit(TinyRegressor())
    with pytest.raises(ValueError, match="gradient_clip_val"):
        make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=1, gradient_clip_val=1.0).fit(TinyRegressor())


@pytest.mark.parametrize(
    ("callback", "tune", "message"),
    [
        (
            LearningRateFinder(num_training_steps=3),
            lambda tuner: tuner.lr_find(TinyRegressor(), num_training=3),
            "LearningRateFinder: it picks the learning rate from noiseless training losses",
        ),
        (
            BatchSizeFinder(steps_per_trial=1),
            lambda tuner: tuner.scale_batch_size(TinyRegressor(), steps_per_trial=1),
            "BatchSizeFinder: a batch size changed mid-run changes the sample rate",
        ),
    ],
    ids=["learning rate", "batch size"],
)
def test_lightnings_tuners_are_rejected_before_any_step(callback, tune, message):
    """As callbacks, and through ``Tuner`` (which adds them, and leaves them on an error: the refusal takes them out,
    so the trainer then fits as built): the learning-rate finder reads noiseless training losses and rewinds the run,
    the batch-size finder changes the sample rate mid-run."""
    strategy = DPStrategy(noise_multiplier=1.0)
    with pytest.raises(ValueError, match=message):
        make_trainer(strategy, max_steps=4, callbacks=[callback]).fit(TinyRegressor())
    assert strategy.privacy_engine.steps == 0
    strategy = DPStrategy(noise_multiplier=1.0)
    trainer = make_trainer(strategy, max_steps=4)
    with pytest.raises(ValueError, match=message):
        tune(Tuner(trainer))
    assert strategy.privacy_engine.steps == 0
    assert not any(isinstance(c, LearningRateFinder | BatchSizeFinder) for c in trainer.callbacks)  # Tuner's, taken out
    trainer.fit(TinyRegressor())
    assert strategy.privacy_engine.steps == 4


class RollBack(Callback):
    """Loads ``path`` into the running fit after step ``at`` (a roll-back on a loss spike, as a callback would)."""

    def __init__(self, path, at: int) -> None:
        self.path, self.at, self.done = path, at, False

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.at and not self.done:
            self.done = True
            trainer._checkpoint_connector.restore(self.path)


def test_a_checkpoint_loaded_while_training_runs_is_refused(tmp_path):
    """It would rewind the ledger over the steps taken since: the run keeps them."""
    first = make_trainer(DPStrategy(noise_multiplier=1.0, seed=0), max_steps=2)
    first.fit(TinyRegressor())
    first.save_checkpoint(tmp_path / "early.ckpt")
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    trainer = make_trainer(strategy, max_steps=6, callbacks=[RollBack(tmp_path / "early.ckpt", at=4)])
    with pytest.raises(ValueError, match="A checkpoint loaded while training runs would rewind the privacy ledger"):
        trainer.fit(TinyRegressor())
    assert strategy.privacy_engine.steps == 4


def _saved(tmp_path, steps: int, name: str, edit=None):
    """A checkpoint of ``steps`` steps of a fit of TinyRegressor, edited by ``edit`` (the loaded dict) if given."""
    trainer = make_trainer(DPStrategy(noise_multiplier=1.0, seed=0), max_steps=steps)
    trainer.fit(TinyRegressor())
    trainer.save_checkpoint(tmp_path / name)
    if edit is not None:
        saved = torch.load(tmp_path / name, weights_only=False)
        edit(saved)
        torch.save(saved, tmp_path / name)
    return tmp_path / name


class FailingFitStart(TinyRegressor):
    """Raises in ``on_fit_start`` (after Lightning loaded the checkpoint, before training starts) while ``fail``."""

    fail = True

    def on_fit_start(self) -> None:
        if self.fail:
            raise RuntimeError("on_fit_start failed")


def test_a_fit_after_a_load_that_no_training_followed_is_refused(tmp_path):
    """A fit that fails after its load leaves the run holding the checkpoint's ledger (and with other failures not
    its weights): the next fit is refused unless it loads a checkpoint itself, which then trains from it."""
    early = _saved(tmp_path, 2, "early.ckpt")
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    trainer, module = make_trainer(strategy, max_steps=6), FailingFitStart()
    with pytest.raises(RuntimeError, match="on_fit_start failed"):
        trainer.fit(module, ckpt_path=early)
    module.fail = False
    with pytest.raises(ValueError, match="A checkpoint loaded into this run was not trained from"):
        trainer.fit(module)
    trainer.fit(module, ckpt_path=early)
    assert strategy.privacy_engine.steps == 6


def test_a_checkpoint_is_not_written_while_a_load_is_unfinished(tmp_path):
    """A fit whose checkpoint has a weight missing fails after the privacy state (2 steps) was loaded, with the
    model's own weights (trained 6 steps): a checkpoint written then would pair them, and a resume from it would count
    2 steps for weights trained 6 more. Refused until a checkpoint is loaded whole."""
    intact = _saved(tmp_path, 2, "early.ckpt")
    broken = _saved(tmp_path, 2, "broken.ckpt", edit=lambda saved: saved["state_dict"].pop("net.0.weight"))
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    trainer, module = make_trainer(strategy, max_steps=6), TinyRegressor()
    trainer.fit(module)
    with pytest.raises(RuntimeError, match="Missing key"):
        trainer.fit(module, ckpt_path=broken)
    with pytest.raises(ValueError, match="A checkpoint's load into this run did not finish"):
        trainer.save_checkpoint(tmp_path / "mixed.ckpt")
    assert not (tmp_path / "mixed.ckpt").exists()
    trainer.fit(module, ckpt_path=intact)
    trainer.save_checkpoint(tmp_path / "resumed.ckpt")  # loaded whole, then trained: written
    assert strategy.privacy_engine.steps == 6


def test_a_non_strict_load_that_leaves_a_trainable_weight_is_refused(tmp_path):
    """With ``strict_loading=False`` a checkpoint without ``net.0.weight`` loads, and the model keeps a weight the
    checkpoint's ledger (2 steps) does not count: here what its earlier fit in this process trained (6 steps), and in
    a freshly built model too (a model built from trained weights could hold them). Refused, and nothing is written
    until a checkpoint is loaded whole."""
    intact = _saved(tmp_path, 2, "early.ckpt")
    broken = _saved(tmp_path, 2, "broken.ckpt", edit=lambda saved: saved["state_dict"].pop("net.0.weight"))
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    trainer, module = make_trainer(strategy, max_steps=6), TinyRegressor()
    module.strict_loading = False
    trainer.fit(module)
    refused = r"did not write trainable parameter\(s\) 'net.0.weight', so they would keep"
    with pytest.raises(ValueError, match=refused):
        trainer.fit(module, ckpt_path=broken)
    with pytest.raises(ValueError, match="A checkpoint's load into this run did not finish"):
        trainer.save_checkpoint(tmp_path / "mixed.ckpt")
    trainer.fit(module, ckpt_path=intact)
    assert strategy.privacy_engine.steps == 6
    fresh = TinyRegressor()
    fresh.strict_loading = False
    with pytest.raises(ValueError, match=refused):
        make_trainer(DPStrategy(noise_multiplier=1.0, seed=0), max_steps=6).fit(fresh, ckpt_path=broken)


class Validated(TinyRegressor):
    """With a validation loop (on the training data) that computes nothing."""

    def validation_step(self, batch, batch_idx) -> None:
        return None

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.data, batch_size=8)


def test_a_failed_load_writes_no_checkpoint_on_exception_and_raises_its_own_error(tmp_path):
    """``OnExceptionCheckpoint`` after a load that failed partway: nothing is written, and the fit raises the error
    that stopped it."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    broken = _saved(tmp_path, 2, "broken.ckpt", edit=lambda saved: saved["state_dict"].pop("net.0.weight"))
    trainer = make_trainer(DPStrategy(noise_multiplier=1.0, seed=0), max_steps=6)
    trainer.callbacks.append(OnExceptionCheckpoint(tmp_path / "on_exception"))
    with pytest.raises(RuntimeError, match="Missing key"):
        trainer.fit(TinyRegressor(), ckpt_path=broken)
    assert not list(tmp_path.rglob("on_exception/*.ckpt"))


def test_a_validate_that_loaded_a_checkpoints_weights_refuses_a_fit_that_loads_none(tmp_path):
    """``validate(ckpt_path=...)`` of a checkpoint without privacy state (trained 4 steps) loads its weights: a fit
    without a checkpoint, or a checkpoint written then, would count only this run's steps for them. A load its checks
    refuse before anything changed (another ``max_grad_norm``) leaves nothing to refuse."""
    stripped = _saved(tmp_path, 4, "stripped.ckpt", edit=lambda saved: saved.pop("lightning_dp"))
    trainer, module = make_trainer(DPStrategy(noise_multiplier=1.0, seed=0), max_steps=2), Validated()
    trainer.fit(module)
    trainer.validate(module, ckpt_path=stripped, verbose=False)
    with pytest.raises(ValueError, match="A checkpoint's load into this run did not finish"):
        trainer.save_checkpoint(tmp_path / "mixed.ckpt")  # its weights with this run's ledger
    trainer.fit_loop.epoch_loop.max_steps = 4  # steps left to take
    with pytest.raises(ValueError, match="A checkpoint loaded into this run was not trained from"):
        trainer.fit(module)
    intact = _saved(tmp_path, 2, "intact.ckpt")
    trainer.validate(module, ckpt_path=intact, verbose=False)  # its privacy state and its weights: written
    trainer.save_checkpoint(tmp_path / "validated.ckpt")
    ((_, steps),) = torch.load(tmp_path / "validated.ckpt", weights_only=False)["lightning_dp"]["accountant"]["ledger"]
    assert steps == 2
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=0.5, seed=0)
    trainer = make_trainer(strategy, max_steps=3)
    with pytest.raises(ValueError, match="max_grad_norm=1.0, this run uses 0.5"):
        trainer.fit(module, ckpt_path=intact)
    trainer.fit(module)
    assert strategy.privacy_engine.steps == 3


def test_calibrated_run_spends_the_target_epsilon():
    callback = PrivacyAccountantCallback()
    strategy = DPStrategy(target_epsilon=2.0, target_delta=1e-5, max_grad_norm=1.0, seed=0)
    make_trainer(strategy, max_epochs=3, callbacks=[callback]).fit(TinyRegressor())
    assert callback.summary["epsilon"] == pytest.approx(2.0, rel=0.01)
    assert callback.summary["epsilon"] <= 2.0 + 1e-9


def test_checkpoint_model_weights_are_plain(tmp_path):
    module = TinyRegressor()
    trainer = make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=2)
    trainer.fit(module)
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    state = torch.load(tmp_path / "m.ckpt", weights_only=False)["state_dict"]
    fresh = TinyRegressor()
    fresh.load_state_dict(state)  # a plain module loads the DP-trained weights: no wrapper prefixes
    for a, b in zip(_params(fresh), _params(module), strict=True):
        torch.testing.assert_close(a, b)


def test_empty_poisson_batches_still_take_noisy_steps():
    module = ZeroGradModule(n=100, batch_size=10)
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.002, seed=1)
    make_trainer(strategy, max_steps=5).fit(module)
    assert strategy.privacy_engine.steps == 5
    assert module.layer.weight.abs().sum() > 0  # noise was added on (mostly) empty batches


class SkipsEmpty(ZeroGradModule):
    """Returns ``None`` for an empty batch, as docs/privacy.md tells a step to whose model fails on zero rows."""

    def training_step(self, batch, batch_idx):
        return None if batch[0].size(0) == 0 else super().training_step(batch, batch_idx)


def test_a_step_returning_none_for_an_empty_batch_still_takes_noisy_steps():
    """HF's attention fails on zero rows (a tiny GPT-2 here), so such a model's step returns ``None`` for an empty
    batch: every step is still noised, taken and accounted."""
    from hf_helpers import tiny_gpt2

    with pytest.raises(RuntimeError, match="0 elements"):
        tiny_gpt2()(input_ids=torch.zeros(0, 4, dtype=torch.long))
    module = SkipsEmpty(n=100, batch_size=10)
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.002, seed=1)
    make_trainer(strategy, max_steps=5).fit(module)
    assert strategy.privacy_engine.steps == 5 and module.layer.weight.abs().sum() > 0


def test_opting_out_of_poisson_sampling_warns(caplog):
    with caplog.at_level("WARNING", logger="lightning_dp"):
        make_trainer(DPStrategy(noise_multiplier=1.0, poisson_sampling=False), max_steps=1).fit(TinyRegressor())
    assert "assumes Poisson" in caplog.text


def test_default_delta_and_large_delta_warning(caplog):
    strategy = DPStrategy(noise_multiplier=1.0)
    make_trainer(strategy, max_steps=1).fit(TinyRegressor())
    assert strategy.privacy_engine.target_delta == pytest.approx(64**-1.1)
    with caplog.at_level("WARNING", logger="lightning_dp"):
        make_trainer(DPStrategy(noise_multiplier=1.0, target_delta=0.05), max_steps=1).fit(TinyRegressor())
    assert "not below 1/N" in caplog.text


def test_manual_optimization_is_rejected():
    module = TinyRegressor()
    module.automatic_optimization = False
    with pytest.raises(ValueError, match="automatic optimization"):
        make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=1).fit(module)


def test_checkpoint_holds_no_randomness_and_resume_does_not_replay_noise(tmp_path):
    _fit_with_checkpoints(tmp_path / "part", 1)
    (ckpt,) = list((tmp_path / "part").iterdir())
    state = torch.load(ckpt, weights_only=False)["lightning_dp"]
    assert set(state) == {"accountant", "mechanism", "target_delta", "sample_rate"}
    first = DPStrategy(noise_multiplier=1.0, seed=3).privacy_engine.randomness
    resumed = DPStrategy(noise_multiplier=1.0, seed=3).privacy_engine.randomness
    resumed.restart(8)
    for a, b in ((first.sampling, resumed.sampling), (first.noise_generator("cpu"), resumed.noise_generator("cpu"))):
        assert not torch.equal(torch.rand(16, generator=a), torch.rand(16, generator=b))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"noise_multiplier": 1.2, "max_grad_norm": 5.0}, "max_grad_norm"), ({"noise_multiplier": 3.0}, "noise")],
)
def test_resume_with_other_clipping_or_noise_fails(tmp_path, kwargs, message):
    _fit_with_checkpoints(tmp_path / "part", 1)
    (ckpt,) = list((tmp_path / "part").iterdir())
    strategy = DPStrategy(seed=3, **kwargs)
    with pytest.raises(ValueError, match=message):
        make_trainer(strategy, max_epochs=2).fit(TinyRegressor(), ckpt_path=ckpt)


class _GradRecorder(Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grad = pl_module.layer.weight.grad.detach().clone()


def test_hooks_before_the_optimizer_step_see_only_noisy_gradients():
    recorder = _GradRecorder()
    module = ZeroGradModule()
    make_trainer(DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), max_steps=1, callbacks=[recorder]).fit(module)
    assert recorder.grad.abs().sum() > 0  # the clipped sum is exactly zero: what the hook saw is the noise
    torch.testing.assert_close(module.layer.weight.detach(), -recorder.grad)  # SGD lr=1 applied what it saw


def test_partial_logical_steps_are_rejected():
    strategy = DPStrategy(noise_multiplier=1.0)
    trainer = make_trainer(strategy, max_epochs=1, accumulate_grad_batches=2, limit_train_batches=5)
    with pytest.raises(ValueError, match="multiple of accumulate_grad_batches"):
        trainer.fit(TinyRegressor(batch_size=4))


def test_unbounded_training_needs_fixed_noise():
    make_trainer(DPStrategy(noise_multiplier=1.0), max_epochs=-1, max_steps=3).fit(TinyRegressor())
    with pytest.raises(ValueError, match="finite number of steps"):
        make_trainer(DPStrategy(target_epsilon=1.0), max_epochs=-1).fit(TinyRegressor())


class _DoubledLoss(TinyRegressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        x2, y2 = torch.cat([x, x + 0.01]), torch.cat([y, y])
        return ((self.net(x2) - y2) ** 2).squeeze(-1)  # two losses per example: sensitivity 2C


def test_more_losses_than_examples_is_rejected():
    with pytest.raises(ValueError, match="one loss per example"):
        make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=1).fit(_DoubledLoss())


def test_a_budget_needs_a_target_epsilon_here_or_in_the_strategy():
    engine = PrivacyEngine(noise_multiplier=1.0, max_grad_norm=1.0)
    with pytest.raises(ValueError, match=r"PrivacyBudget needs target_epsilon \(here or in DPStrategy\)"):
        engine.set_epsilon_budget(None, configured_in="DPStrategy")
    engine.set_epsilon_budget(2.0, configured_in="DPStrategy")
    assert engine.epsilon_budget == 2.0


class ForeignTensorRegressor(TinyRegressor):
    """Its optimizer also updates a tensor outside the module, which the clipping hooks never see."""

    def configure_optimizers(self):
        outside = torch.zeros(3, requires_grad=True)  # not registered in the module
        return torch.optim.SGD([*self.parameters(), outside], lr=self.lr)


def test_an_optimizer_over_tensors_outside_the_model_is_refused() -> None:
    """The engine's rule, shared with DPTrainer: a tensor the optimizer updates but no clipping hook sees would be
    noised, never clipped."""
    trainer = make_trainer(DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0), max_steps=1)
    with pytest.raises(ValueError, match=r"updates 1 tensor\(s\) that are not parameters of the model"):
        trainer.fit(ForeignTensorRegressor())
