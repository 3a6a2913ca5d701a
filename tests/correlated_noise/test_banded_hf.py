"""``noise_correlation='banded'`` through ``DPTrainer`` on a tiny GPT-2: the banded-mf epsilon, a checkpoint with the
strategy and no noise state, the resume as a new segment, the refused resume that would skip batches, and 2 processes
under ``accelerate launch`` (``hf_ddp_script.py --banded``) against one."""

from __future__ import annotations

import json

import pytest
import torch
from hf_helpers import NO_DROPOUT, TokenDataset, make_trainer, tiny_gpt2
from process_helpers import SCRIPTS, accelerate_launch

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


@pytest.mark.parametrize("kind", ["banded", "blt"])
def test_two_processes_under_accelerate_equal_one_process_at_group_rate_one(tmp_path, kind):
    """``accelerate launch`` on 2 processes, b = 2 and q = 1/2 (q_b = 1: step t's union over the ranks is ALL of group
    t mod 2), 2 micro-batches per step, banded (band 2) or BLT (2 buffers, b = floor(1 / q) = 2): the ranks hold the
    same partition, every micro-batch of step t comes from the rank's shard of group t mod 2, the ranks end identical,
    and parameters, ledger and epsilon equal the one-process DPTrainer run of the same seed."""
    out = tmp_path / "ranks"
    accelerate_launch(SCRIPTS / "hf_ddp_script.py", str(out), f"--{kind}", "2")
    a, b = ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert a["end"] == b["end"] and a["state"] == b["state"] and a["steps"] == b["steps"] == 4
    groups = torch.tensor(a["groups"])
    assert b["groups"] == a["groups"] and len(set(a["groups"])) == 2
    for rank, record in enumerate(ranks):
        assert len(record["micro_batches"]) == 4 * 2  # every rank joins every micro-step
        for k, batch in enumerate(record["micro_batches"]):
            assert all(i % 2 == rank for i in batch) and set(groups[batch].tolist()) <= {(k // 2) % 2}
    for t in range(4):
        union = sorted(i for record in ranks for batch in record["micro_batches"][2 * t : 2 * t + 2] for i in batch)
        assert union == (groups == t % 2).nonzero().flatten().tolist()

    blt = {**BANDED, "noise_correlation": "blt", "correlation_band": None, "correlation_buffers": 2}
    privacy = PrivacyArguments(**(BANDED if kind == "banded" else blt), sample_rate=0.5)  # hf_ddp_script.py's
    options = dict(per_device_train_batch_size=8, gradient_accumulation_steps=2, max_steps=4)
    single = make_trainer(
        tiny_gpt2(**NO_DROPOUT), tmp_path / "single", TokenDataset(n=32), privacy=privacy, args=options
    )
    single.train()
    engine = single.privacy_engine
    assert json.loads(json.dumps(engine.state_dict())) == a["state"]  # the ranks wrote JSON (tuples as lists)
    assert engine.epsilon() == pytest.approx(a["epsilon"], rel=1e-12)
    for got, want in zip(a["params"], single.model.parameters(), strict=True):
        torch.testing.assert_close(torch.tensor(got), want.detach().flatten())  # the all-reduce only reorders the sum
