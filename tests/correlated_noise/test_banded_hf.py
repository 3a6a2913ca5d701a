"""``noise_correlation='banded'`` through ``DPTrainer`` on a tiny GPT-2: the banded-mf epsilon, a checkpoint with the
strategy and no noise state, the resume as a new segment, and the refused resume that would skip batches."""

from __future__ import annotations

import json

import pytest
from hf_helpers import make_trainer, tiny_gpt2

from lightning_dp.accounting.banded_mf import banded_mf_epsilon
from lightning_dp.hf import PrivacyArguments
from lightning_dp.hf.callbacks import PRIVACY_STATE_NAME

BANDED = dict(
    noise_multiplier=1.0, noise_correlation="banded", correlation_band=2, dp_seed=0, check_batch_independence=False
)
CHECKPOINTS = dict(max_steps=4, save_strategy="steps", save_steps=2, logging_steps=100)  # epsilon (PLD) at the end only


def test_banded_training_checkpoint_and_resume(tmp_path):
    trainer = make_trainer(tiny_gpt2(), tmp_path, privacy=PrivacyArguments(**BANDED), args=CHECKPOINTS)
    trainer.train()
    engine = trainer.privacy_engine
    plan = engine.state.correlation
    assert engine.steps == 4 and engine.accountant.name == "banded-mf" and plan.band == 2
    expected = banded_mf_epsilon(
        plan.strategy,
        steps=4,
        noise_multiplier=plan.column_norm,
        group_sample_rate=2 * engine.sample_rate,
        delta=engine.target_delta,
        num_groups=2,
    )
    assert engine.epsilon() == expected
    state = json.loads((tmp_path / "checkpoint-2" / PRIVACY_STATE_NAME).read_text())
    assert state["noise_correlation"] == {"kind": "banded", "coefs": list(plan.strategy.coefs)}
    assert sorted(p.name for p in (tmp_path / "checkpoint-2").glob("lightning_dp*")) == [PRIVACY_STATE_NAME]

    # a resume must not skip the epoch's first batches (they would shift the groups); it starts a new segment
    checkpoint = str(tmp_path / "checkpoint-2")
    skipping = make_trainer(tiny_gpt2(), tmp_path, privacy=PrivacyArguments(**BANDED), args=CHECKPOINTS)
    with pytest.raises(ValueError, match=r"resumes only with TrainingArguments\(ignore_data_skip=True\)"):
        skipping.train(resume_from_checkpoint=checkpoint)
    resumed = make_trainer(
        tiny_gpt2(), tmp_path, privacy=PrivacyArguments(**BANDED), args={**CHECKPOINTS, "ignore_data_skip": True}
    )
    resumed.train(resume_from_checkpoint=checkpoint)
    ledger = resumed.privacy_engine.accountant.ledger
    assert [(event.segment, count) for event, count in ledger] == [(0, 2), (1, 2)]


def test_several_processes_are_refused_under_dptrainer(tmp_path, monkeypatch):
    """Banded noise on several processes is tested under Lightning's DPDDPStrategy only: DPTrainer on a process group
    refuses it at ``train`` (one line), before the model is broadcast or any step runs."""
    import lightning_dp.hf.trainer as hf_trainer

    monkeypatch.setattr(hf_trainer, "distributed_context", lambda: object())
    trainer = make_trainer(tiny_gpt2(), tmp_path, privacy=PrivacyArguments(**BANDED), args=CHECKPOINTS)
    with pytest.raises(ValueError, match="^noise_correlation='banded' runs on one process under DPTrainer for now"):
        trainer.train()
    assert trainer.privacy_engine.steps == 0
