"""``exact_resume=True`` under Lightning: a checkpoint keeps the run's secret randomness (base seed, noise generators'
states) and the correlated noise's stream, so a run resumed mid-band from it equals the uninterrupted run: the same
batches at every step, parameters bit for bit, one segment of the ledger and the same epsilon. Without the option the
checkpoint keeps none of it (tests/correlated_noise/test_banded_resume.py) and the resumed run differs."""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import BatchIndexRecorder, TinyRegressor, make_trainer, regression_data
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dp import DPStrategy
from lightning_dp.engine.exact_resume import SECRET_KEY

STEPS, CUT = 14, 5
NOISES = {
    "independent": {},
    "banded": {"noise_correlation": "banded", "correlation_band": 4},
    "blt": {"noise_correlation": "blt", "correlation_buffers": 2},
}


def _fit(ckpt_path=None, checkpoints=None, *, exact_resume: bool = True, seed: int | None = 0, **options):
    """A run planned for ``STEPS`` steps (from ``ckpt_path``), with batch 8 of 64 examples (q = 1/8: banded samples
    its group at q_b = 1/2, BLT cycles over b = 8 groups); with ``checkpoints`` a folder, a checkpoint every ``CUT``
    steps."""
    strategy = DPStrategy(noise_multiplier=1.0, seed=seed, exact_resume=exact_resume, **options)
    torch.manual_seed(0)
    module = TinyRegressor(batch_size=8)
    callbacks: list = [BatchIndexRecorder(regression_data().tensors[0])]
    if checkpoints is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=CUT, save_top_k=-1))
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
