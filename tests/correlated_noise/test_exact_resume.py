"""``exact_resume=True`` under Lightning: a checkpoint keeps the run's secret randomness (base seed, noise generators'
states) and the correlated noise's stream, so a run resumed mid-band from it equals the uninterrupted run: the same
batches at every step, parameters bit for bit, one segment of the ledger and the same epsilon. Without the option the
checkpoint keeps none of it (tests/correlated_noise/test_banded_resume.py) and the resumed run differs."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from helpers import BatchIndexRecorder, TinyRegressor, make_trainer, nested_equal, regression_data
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dp import DPStrategy
from lightning_dp.engine.exact_resume import SECRET_KEY
from lightning_dp.lightning.global_randomness import KEY, GlobalRandomness

STEPS, CUT = 14, 5
#: the refusal of a start after a load that no start of training followed
REFUSED = "A checkpoint loaded into this run was not trained from"
NOISES = {
    "independent": {},
    "banded": {"noise_correlation": "banded", "correlation_band": 4},
    "blt": {"noise_correlation": "blt", "correlation_buffers": 2},
}


class DropoutRegressor(TinyRegressor):
    """:class:`TinyRegressor` with dropout on its hidden layer: masks drawn from torch's global generator."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.net.insert(2, torch.nn.Dropout(0.5))


def _fit(
    ckpt_path=None,
    checkpoints=None,
    *,
    exact_resume: bool = True,
    seed: int | None = 0,
    module_class=TinyRegressor,
    cut: int = CUT,
    global_seed: int = 0,
    **options,
):
    """A run planned for ``STEPS`` steps (from ``ckpt_path``), with batch 8 of 64 examples (q = 1/8: banded samples
    its group at q_b = 1/2, BLT cycles over b = 8 groups); with ``checkpoints`` a folder, a checkpoint every ``cut``
    steps; torch's global generator seeded with ``global_seed`` before the module is built."""
    strategy = DPStrategy(noise_multiplier=1.0, seed=seed, exact_resume=exact_resume, **options)
    torch.manual_seed(global_seed)
    module = module_class(batch_size=8)
    callbacks: list = [BatchIndexRecorder(regression_data().tensors[0])]
    if checkpoints is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=cut, save_top_k=-1))
    trainer = make_trainer(strategy, max_steps=STEPS, callbacks=callbacks, enable_checkpointing=checkpoints is not None)
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer, strategy, module, callbacks[0].batches


def _interrupted(tmp_path, **options):
    """The run checkpointing every ``CUT`` steps, and the run resumed from its first checkpoint (step ``CUT``)."""
    whole = _fit(checkpoints=tmp_path, **options)
    (cut,) = tmp_path.glob(f"*step={CUT}.ckpt")
    return whole, _fit(cut, **options)


@pytest.mark.parametrize(("noise", "seed"), [("independent", 0), ("banded", 0), ("blt", 0), ("banded", None)], ids=str)
def test_a_resumed_run_equals_the_uninterrupted_run(tmp_path, noise, seed):
    """Also unseeded (OS entropy): the checkpoint's base seed is what keeps the partition and the streams."""
    whole_run, resumed_run = _interrupted(tmp_path, seed=seed, **NOISES[noise])
    (_, whole, whole_module, whole_batches), (_, resumed, module, batches) = whole_run, resumed_run
    assert batches == whole_batches[CUT:] and any(batches)  # the same examples at every resumed step
    for got, want in zip(module.parameters(), whole_module.parameters(), strict=True):
        assert torch.equal(got, want)
    engine = resumed.privacy_engine
    assert engine.accountant.state_dict() == whole.privacy_engine.accountant.state_dict()
    assert engine.epsilon() == whole.privacy_engine.epsilon()
    startup = "\n".join(engine.startup_lines())
    assert "  checkpoints" + " " * 13 + "hold the secret randomness and noise state (exact_resume)" in startup
    if noise != "independent":
        assert [(event.segment, count) for event, count in engine.accountant.ledger] == [(0, STEPS)]
        (optimizer,) = engine._optimizers
        assert optimizer.correlation.step_index == STEPS  # the checkpoint's stream, continued
        assert "segment" not in startup


@pytest.mark.parametrize("cut", [CUT, 8], ids=["mid-epoch", "epoch end"])
def test_a_resumed_run_continues_the_models_own_randomness(tmp_path, cut):
    """Dropout draws from torch's global generator, which Lightning's checkpoints do not keep: with ``exact_resume``
    the checkpoint holds it, so a resume whose process drew other numbers before (another global seed) equals the
    uninterrupted run, and two resumes from one checkpoint compute the same gradients."""
    options = {"module_class": DropoutRegressor, "cut": cut}
    _, _, whole, _ = _fit(checkpoints=tmp_path, **options)
    (checkpoint,) = tmp_path.glob(f"*step={cut}.ckpt")
    _, _, resumed, _ = _fit(checkpoint, global_seed=123, **options)
    for got, want in zip(resumed.parameters(), whole.parameters(), strict=True):
        assert torch.equal(got, want)
    states = torch.load(checkpoint, weights_only=True)["lightning_dp"][SECRET_KEY]["global_randomness"]  # plain data
    assert len(states) == 1 and states[0].keys() == {"torch", "numpy", "python", "accelerator"}


@pytest.mark.parametrize("noise", ["independent", "banded"])
def test_a_refused_resume_stays_refused(tmp_path, noise):
    """A resume that trains other parameters than the checkpoint's noise was drawn for is refused before any noise is
    drawn; so is a later ``fit`` of the same run without ``ckpt_path``, even with the checkpoint's parameters (it would
    continue the restored streams with its own optimizer state and randomness), and a checkpoint written meanwhile
    holds the checkpoint's schedule. Loading the checkpoint again resumes it: the uninterrupted run, bit for bit."""
    _, _, whole, _ = _fit(checkpoints=tmp_path, **NOISES[noise])
    (checkpoint,) = tmp_path.glob(f"*step={CUT}.ckpt")
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, exact_resume=True, **NOISES[noise])
    module = TinyRegressor(batch_size=8)
    module.net[2].bias.requires_grad_(False)
    trainer = make_trainer(strategy, max_steps=STEPS)
    with pytest.raises(ValueError, match="drawn for .*'net.2.bias'.* this run draws it for .*no parameter"):
        trainer.fit(module, ckpt_path=checkpoint)
    module.net[2].bias.requires_grad_(True)
    with pytest.raises(ValueError, match=REFUSED):
        trainer.fit(module)
    saved = torch.load(checkpoint, weights_only=True)["lightning_dp"][SECRET_KEY]
    assert strategy.privacy_engine.state_dict()[SECRET_KEY]["draw_schedule"] == saved["draw_schedule"]
    trainer.fit(module, ckpt_path=checkpoint)
    for got, want in zip(module.parameters(), whole.parameters(), strict=True):
        assert torch.equal(got, want)


class OutsideTensorRegressor(TinyRegressor):
    """While ``outside``, its optimizer updates a tensor outside the module in place of the module's last parameter (so
    that the checkpoint's optimizer state still loads)."""

    outside = True

    def configure_optimizers(self):
        *inside, last = self.parameters()
        stand_in = torch.zeros_like(last, requires_grad=True) if self.outside else last
        return torch.optim.SGD([*inside, stand_in], lr=self.lr)


@pytest.mark.parametrize("noise", ["independent", "banded"])
def test_a_resume_whose_optimizer_updates_a_tensor_outside_the_model_is_refused_for_that(tmp_path, noise):
    """The message names the cause (checked before the draw schedule, whose difference it also makes), and the refusal
    stays: a later ``fit`` of the run with the model's own parameters is refused too, until the checkpoint is loaded
    again."""
    _fit(checkpoints=tmp_path, **NOISES[noise])
    (checkpoint,) = tmp_path.glob(f"*step={CUT}.ckpt")
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, exact_resume=True, **NOISES[noise])
    trainer = make_trainer(strategy, max_steps=STEPS)
    module = OutsideTensorRegressor(batch_size=8)
    with pytest.raises(ValueError, match=r"updates 1 tensor\(s\) that are not parameters of the model"):
        trainer.fit(module, ckpt_path=checkpoint)
    module.outside = False
    with pytest.raises(ValueError, match=REFUSED):
        trainer.fit(module)


class FailingStartRegressor(TinyRegressor):
    """While ``fail``, raises in ``on_fit_start`` (after Lightning loaded the checkpoint, before training starts); it
    validates on its training data."""

    fail = True

    def on_fit_start(self):
        if self.fail:
            raise RuntimeError("on_fit_start failed")

    def validation_step(self, batch, batch_idx):
        return self.training_step(batch, batch_idx).mean()

    def val_dataloader(self):
        return self.train_dataloader()


@pytest.mark.parametrize("noise", ["independent", "banded"])
def test_a_restore_no_training_started_from_stays_refused(tmp_path, noise):
    """A fit from the checkpoint that fails after the load but before the draw schedule is checked (a hook raising),
    and a validate that loads the checkpoint, leave its secret state unused: a later ``fit`` without ``ckpt_path`` is
    refused (it would continue the restored streams with a fresh optimizer state and randomness), and stays refused
    after a fit whose load fails (another clipping bound, a corrupted entry), until a fit from the checkpoint resumes
    it, bit for bit."""
    _, _, whole, _ = _fit(checkpoints=tmp_path, **NOISES[noise])
    (checkpoint,) = tmp_path.glob(f"*step={CUT}.ckpt")
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, exact_resume=True, **NOISES[noise])
    trainer = make_trainer(strategy, max_steps=STEPS)
    module = FailingStartRegressor(batch_size=8)
    with pytest.raises(RuntimeError, match="on_fit_start failed"):
        trainer.fit(module, ckpt_path=checkpoint)
    module.fail = False
    with pytest.raises(ValueError, match=REFUSED):
        trainer.fit(module)
    trainer.validate(module, ckpt_path=checkpoint)
    with pytest.raises(ValueError, match=REFUSED):
        trainer.fit(module)
    saved = torch.load(checkpoint, weights_only=False)
    saved["lightning_dp"]["mechanism"]["max_grad_norm"] = 0.5
    torch.save(saved, tmp_path / "other_bound.ckpt")
    saved["lightning_dp"]["mechanism"]["max_grad_norm"] = 1.0
    saved["lightning_dp"][SECRET_KEY]["noise_streams"] = None
    torch.save(saved, tmp_path / "corrupted.ckpt")
    for failing, message in (("other_bound.ckpt", "max_grad_norm"), ("corrupted.ckpt", "entry is corrupted")):
        with pytest.raises(ValueError, match=message):  # a load that fails keeps the earlier load's refusal
            trainer.fit(module, ckpt_path=tmp_path / failing)
        with pytest.raises(ValueError, match=REFUSED):
            trainer.fit(module)
    trainer.fit(module, ckpt_path=checkpoint)
    for got, want in zip(module.parameters(), whole.parameters(), strict=True):
        assert torch.equal(got, want)


def test_a_refused_load_leaves_the_run_as_it_was(tmp_path):
    """A load refused at any of its checks (another clipping bound, a corrupted secret or global random state, an
    empty ledger in a checkpoint that took steps) changes nothing of the run: not its ledger (a later ``fit`` would
    otherwise count the checkpoint's steps for a model trained longer), nor its randomness or pending restore, and it
    marks no load (a checkpoint is written after it)."""
    trainer, strategy, module, _ = _fit(checkpoints=tmp_path, **NOISES["banded"])
    (checkpoint,) = tmp_path.glob(f"*step={CUT}.ckpt")
    engine = strategy.privacy_engine
    before = (engine.accountant.state_dict(), engine.state.randomness.state_dict(), engine.state.restored_draw_schedule)
    damages = [
        ("max_grad_norm", lambda entry: entry["mechanism"].update(max_grad_norm=0.5)),
        ("entry is corrupted", lambda entry: entry[SECRET_KEY].update(randomness=None)),
        ("global_randomness entry is corrupted", lambda entry: entry[SECRET_KEY].update(global_randomness="x")),
        (  # well formed, but not a state torch's generator takes
            "global_randomness entry is corrupted",
            lambda entry: entry[SECRET_KEY]["global_randomness"][0].update(torch=torch.zeros(3)),
        ),
        ("privacy ledger is empty", lambda entry: entry["accountant"].update(ledger=[])),
    ]
    for message, damage in damages:
        saved = torch.load(checkpoint, weights_only=False)
        damage(saved["lightning_dp"])
        torch.save(saved, tmp_path / "damaged.ckpt")
        with pytest.raises(ValueError, match=message):
            trainer.fit(module, ckpt_path=tmp_path / "damaged.ckpt")
        assert engine.steps == STEPS
        after = (engine.accountant.state_dict(), engine.state.randomness.state_dict())
        assert after[0] == before[0] and nested_equal(after[1], before[1]), message
        assert engine.state.restored_draw_schedule == before[2]
        assert not (engine.state.load_unfinished or engine.state.load_partial), message  # marks nothing
    trainer.save_checkpoint(tmp_path / "after.ckpt")  # the run is its own: written


def test_without_the_option_the_resumed_run_draws_fresh_streams(tmp_path):
    whole, resumed_run = _interrupted(tmp_path, exact_resume=False, **NOISES["banded"])
    (_, _, whole_module, whole_batches), (_, resumed, module, batches) = whole, resumed_run
    assert batches != whole_batches[CUT:]
    assert not all(torch.equal(a, b) for a, b in zip(module.parameters(), whole_module.parameters(), strict=True))
    assert [event.segment for event, _ in resumed.privacy_engine.accountant.ledger] == [0, 1]


def _saved(folder, exact_resume: bool) -> dict:
    """The privacy state of the step-``CUT`` checkpoint of a banded run."""
    _fit(checkpoints=folder, exact_resume=exact_resume, **NOISES["banded"])
    (cut,) = folder.glob(f"*step={CUT}.ckpt")
    return torch.load(cut, weights_only=False)["lightning_dp"]


def test_the_checkpoint_holds_the_secret_state_only_with_the_option(tmp_path):
    """Not in a weights-only checkpoint either (it cannot resume, and it is the file users release)."""
    secret = _saved(tmp_path / "exact", exact_resume=True)[SECRET_KEY]
    (stream,) = secret["noise_streams"]
    assert stream["step"] == CUT and len(stream["state"]) == 3  # b - 1 past noise vectors
    assert secret["randomness"]["base_seed"] == 0 and secret["randomness"]["generators"]
    assert SECRET_KEY not in _saved(tmp_path / "plain", exact_resume=False)
    trainer, *_ = _fit(**NOISES["banded"])
    trainer.save_checkpoint(tmp_path / "weights.ckpt", weights_only=True)
    assert SECRET_KEY not in torch.load(tmp_path / "weights.ckpt", weights_only=False)["lightning_dp"]


def test_a_restored_state_is_saved_again_until_used_and_a_later_load_clears_it(tmp_path):
    """A checkpoint written between a restore and the first step keeps the restored noise streams (not an empty list,
    which a resume would refuse, nor fresh streams); a later load of a checkpoint without the secret state leaves
    nothing of the first load to continue, so its correlation restarts."""
    saved = _saved(tmp_path / "exact", exact_resume=True)
    engine = DPStrategy(noise_multiplier=1.0, exact_resume=True, **NOISES["banded"]).privacy_engine
    engine.load_state_dict(saved)
    again = engine.state_dict()[SECRET_KEY]
    assert again["randomness"]["base_seed"] == 0 and again["randomness"]["generators"].keys() == {"noise/cpu/0/"}
    (stream,) = again["noise_streams"]
    assert stream["step"] == CUT and all(
        torch.equal(a, b)
        for u, v in zip(stream["state"], saved[SECRET_KEY]["noise_streams"][0]["state"], strict=True)
        for a, b in zip(u, v, strict=True)
    )
    engine.load_state_dict({key: value for key, value in saved.items() if key != SECRET_KEY})
    assert engine.state.restored_noise_streams is None


def test_a_checkpoint_without_the_secret_state_restarts_with_a_warning(tmp_path, caplog):
    _fit(checkpoints=tmp_path, exact_resume=False, **NOISES["banded"])
    (cut,) = tmp_path.glob(f"*step={CUT}.ckpt")
    with caplog.at_level(logging.WARNING, logger="lightning_dp"):
        _, resumed, *_ = _fit(cut, **NOISES["banded"])
    assert "written without it (no secret state): the random streams restart" in caplog.text
    assert [event.segment for event, _ in resumed.privacy_engine.accountant.ledger] == [0, 1]


def test_noise_streams_that_do_not_continue_the_ledger_are_refused(tmp_path):
    """A stream must have taken exactly the steps of the ledger's last segment: another count would continue a
    correlation the accountant does not describe."""
    _fit(checkpoints=tmp_path, **NOISES["banded"])
    (cut,) = tmp_path.glob(f"*step={CUT}.ckpt")
    checkpoint = torch.load(cut, weights_only=False)
    checkpoint["lightning_dp"][SECRET_KEY]["noise_streams"][0]["step"] = CUT - 1
    torch.save(checkpoint, tmp_path / "bad.ckpt")
    with pytest.raises(ValueError, match=r"noise streams \(\[4\] steps\) do not continue its ledger"):
        _fit(tmp_path / "bad.ckpt", **NOISES["banded"])


def test_the_global_random_state_is_restored_and_saved_again_until_training_starts():
    """torch's, numpy's and Python's global generators come back as saved; until training starts a checkpoint keeps
    the restored states (a checkpoint written after a refused resume is the loaded one's), then the current ones; a
    malformed entry is refused, and states of another number of processes are left to the draw schedule's refusal."""
    cpu, randomness = torch.device("cpu"), GlobalRandomness()
    saved: dict = {}
    randomness.save(saved, cpu, None)
    expected = (torch.rand(2), np.random.rand(2), random.random())  # noqa: NPY002 - the global generators
    randomness.restore(saved, cpu, rank=0, world_size=1)
    assert nested_equal((torch.rand(2), np.random.rand(2), random.random()), expected)  # noqa: NPY002
    again: dict = {}
    randomness.save(again, cpu, None)
    assert again[KEY] is saved[KEY]
    randomness.started()
    randomness.save(again, cpu, None)
    assert not nested_equal(again[KEY], saved[KEY])
    state = torch.get_rng_state()
    GlobalRandomness().restore(saved, cpu, rank=1, world_size=2)
    assert torch.equal(torch.get_rng_state(), state)
    with pytest.raises(ValueError, match="global_randomness entry is corrupted"):
        GlobalRandomness().restore({KEY: [{"torch": state}]}, cpu, rank=0, world_size=1)
