"""``exact_resume=True`` through ``DPTrainer`` on a tiny GPT-2: the secret state goes to its own file beside the
checkpoint, and a run resumed from a mid-run checkpoint (``ignore_data_skip=True``) equals the uninterrupted run:
parameters bit for bit, one segment of the ledger and the same epsilon, for independent, banded and BLT noise."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from hf_helpers import NO_DROPOUT, TokenDataset, make_trainer, tiny_gpt2

from lightning_dp.hf import PrivacyArguments
from lightning_dp.hf.callbacks import TENSOR_STATE_NAMES

#: the refusal of a start after a load that no start of training followed
REFUSED = "A checkpoint loaded into this run was not trained from"
NOISES = {
    "independent": {},
    "banded": {"noise_correlation": "banded", "correlation_band": 2},
    "blt": {"noise_correlation": "blt", "correlation_buffers": 2},
}
#: 32 examples, batch 4 (q = 1/8: BLT cycles over b = 8 groups), a checkpoint every 4 of the 10 steps.
ARGS = dict(max_steps=10, save_strategy="steps", save_steps=4, logging_steps=100, ignore_data_skip=True)


def _trainer(tmp_path, *, exact_resume=True, max_steps=10, **noise):
    privacy = PrivacyArguments(
        noise_multiplier=1.0, dp_seed=0, exact_resume=exact_resume, check_batch_independence=False, **noise
    )
    args = {**ARGS, "max_steps": max_steps}
    return make_trainer(tiny_gpt2(**NO_DROPOUT), tmp_path, TokenDataset(), privacy=privacy, args=args)


def _train(tmp_path, resume_from_checkpoint=None, **options):
    trainer = _trainer(tmp_path, **options)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return trainer


@pytest.mark.parametrize("noise", list(NOISES))
def test_a_resumed_run_equals_the_uninterrupted_run(tmp_path, noise):
    whole = _train(tmp_path / "whole", **NOISES[noise])
    checkpoint = tmp_path / "whole" / "checkpoint-4"
    assert (checkpoint / TENSOR_STATE_NAMES["exact_resume"]).is_file()
    resumed = _train(tmp_path / "resumed", resume_from_checkpoint=str(checkpoint), **NOISES[noise])
    for (name, got), want in zip(resumed.model.named_parameters(), whole.model.parameters(), strict=True):
        assert torch.equal(got, want), name
    engine, reference = resumed.privacy_engine, whole.privacy_engine
    assert engine.accountant.state_dict() == reference.accountant.state_dict()
    assert engine.epsilon() == reference.epsilon()
    if noise != "independent":
        assert [(event.segment, count) for event, count in engine.accountant.ledger] == [(0, 10)]


def test_a_secret_file_of_another_run_is_never_continued(tmp_path, caplog):
    """A run rewriting a checkpoint folder removes the secret file an earlier run left there; one copied back (or
    left by a kill) does not carry the folder's token, so a resume ignores it, says so, and restarts the streams."""
    _train(tmp_path, max_steps=4, **NOISES["banded"])
    secret = tmp_path / "checkpoint-4" / TENSOR_STATE_NAMES["exact_resume"]
    stale = secret.read_bytes()
    _train(tmp_path, exact_resume=False, max_steps=4, **NOISES["banded"])
    assert not secret.exists()
    secret.write_bytes(stale)
    with caplog.at_level(logging.WARNING, logger="lightning_dp"):
        resumed = _train(
            tmp_path / "resumed", resume_from_checkpoint=str(tmp_path / "checkpoint-4"), **NOISES["banded"]
        )
    assert (
        "lightning_dp_exact_resume.pt was not written with this checkpoint's privacy state (which has no exact_resume "
        "token): ignored" in caplog.text
    )
    assert [event.segment for event, _ in resumed.privacy_engine.accountant.ledger] == [0, 1]


def test_a_model_only_checkpoint_holds_no_secret_state(tmp_path):
    """``save_only_model=True`` folders cannot resume training and are the ones users publish."""
    privacy = PrivacyArguments(noise_multiplier=1.0, dp_seed=0, exact_resume=True, check_batch_independence=False)
    args = {**ARGS, "max_steps": 4, "save_only_model": True}
    make_trainer(tiny_gpt2(**NO_DROPOUT), tmp_path, TokenDataset(), privacy=privacy, args=args).train()
    assert (tmp_path / "checkpoint-4").is_dir()
    assert not (tmp_path / "checkpoint-4" / TENSOR_STATE_NAMES["exact_resume"]).exists()


def test_a_second_train_starts_training_again_and_checks_the_checkpoints_draw_schedule(tmp_path):
    """A second ``train()`` of the same DPTrainer wraps its optimizer afresh (the Trainer keeps the first one), so
    what is checked as training starts runs again: here a checkpoint recorded on 2 processes is refused on one."""
    trainer = _train(tmp_path, max_steps=4)
    secret_path = tmp_path / "checkpoint-4" / TENSOR_STATE_NAMES["exact_resume"]
    secret = torch.load(secret_path, weights_only=True)
    secret["draw_schedule"]["world_size"] = 2
    torch.save(secret, secret_path)
    trainer.args.max_steps = 8
    refused = "exact_resume: the checkpoint's noise was drawn on world size 2, this run draws it on world size 1"
    with pytest.raises(ValueError, match=refused):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))


@pytest.mark.parametrize(("noise", "exact_resume"), [("independent", True), ("banded", True), ("independent", False)])
def test_a_restore_no_training_started_from_stays_refused(tmp_path, noise, exact_resume):
    """A ``train()`` from a checkpoint whose model weights are missing fails after the privacy state was restored,
    before training starts: a later ``train()`` without ``resume_from_checkpoint`` is refused (it would continue the
    restored streams with a fresh optimizer state, and without ``exact_resume`` too: the checkpoint's ledger with
    the weights the model had), until a ``train()`` from the intact checkpoint resumes it (bit for bit with
    ``exact_resume``)."""
    whole = _train(tmp_path / "whole", **NOISES[noise])
    checkpoint = tmp_path / "whole" / "checkpoint-4"
    shutil.copytree(checkpoint, tmp_path / "broken")
    (tmp_path / "broken" / "model.safetensors").unlink()
    trainer = _trainer(tmp_path / "resumed", exact_resume=exact_resume, **NOISES[noise])
    with pytest.raises(ValueError, match="Can't find a valid checkpoint"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "broken"))
    with pytest.raises(ValueError, match=REFUSED):
        trainer.train()
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.privacy_engine.steps == 10
    for (name, got), want in zip(trainer.model.named_parameters(), whole.model.parameters(), strict=True):
        assert torch.equal(got, want) or not exact_resume, name


def test_a_checkpoint_without_a_trainable_weight_is_refused(tmp_path):
    """The HF Trainer loads weights non-strictly: a checkpoint without a trainable weight loads with a warning, and
    the model keeps a weight the checkpoint's ledger (4 steps) does not count: here what its earlier ``train()`` in
    this process trained (10 steps), and in a freshly built model too. Refused, and so is a ``train()`` without a
    checkpoint after it; the intact checkpoint then resumes."""
    from safetensors.torch import load_file, save_file

    trainer = _train(tmp_path / "whole", exact_resume=False)
    intact = tmp_path / "whole" / "checkpoint-4"
    shutil.copytree(intact, tmp_path / "broken")
    weights = load_file(tmp_path / "broken" / "model.safetensors")
    del weights["transformer.h.0.mlp.c_fc.weight"]
    save_file(weights, tmp_path / "broken" / "model.safetensors", metadata={"format": "pt"})
    refused = r"did not write trainable parameter\(s\) 'transformer.h.0.mlp.c_fc.weight', so they would keep"
    with pytest.raises(ValueError, match=refused):
        trainer.train(resume_from_checkpoint=str(tmp_path / "broken"))
    with pytest.raises(ValueError, match=REFUSED):
        trainer.train()
    trainer.train(resume_from_checkpoint=str(intact))
    assert trainer.privacy_engine.steps == 10
    with pytest.raises(ValueError, match=refused):
        _trainer(tmp_path / "fresh", exact_resume=False).train(resume_from_checkpoint=str(tmp_path / "broken"))
