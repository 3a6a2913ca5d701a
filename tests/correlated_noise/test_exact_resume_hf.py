"""``exact_resume=True`` through ``DPTrainer`` on a tiny GPT-2: the secret state goes to its own file beside the
checkpoint, and a run resumed from a mid-run checkpoint (``ignore_data_skip=True``) equals the uninterrupted run:
parameters bit for bit, one segment of the ledger and the same epsilon, for independent, banded and BLT noise."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import NO_DROPOUT, TokenDataset, make_trainer, tiny_gpt2

from lightning_dp.hf import PrivacyArguments
from lightning_dp.hf.callbacks import TENSOR_STATE_NAMES

NOISES = {
    "independent": {},
    "banded": {"noise_correlation": "banded", "correlation_band": 2},
    "blt": {"noise_correlation": "blt", "correlation_buffers": 2},
}
#: 32 examples, batch 4 (q = 1/8: BLT cycles over b = 8 groups), a checkpoint every 4 of the 10 steps.
ARGS = dict(max_steps=10, save_strategy="steps", save_steps=4, logging_steps=100, ignore_data_skip=True)


def _train(tmp_path, resume_from_checkpoint=None, **noise):
    privacy = PrivacyArguments(
        noise_multiplier=1.0, dp_seed=0, exact_resume=True, check_batch_independence=False, **noise
    )
    trainer = make_trainer(tiny_gpt2(**NO_DROPOUT), tmp_path, TokenDataset(), privacy=privacy, args=ARGS)
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
