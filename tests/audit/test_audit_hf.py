"""The gradient-canary audit on the HF path (DPTrainer)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from hf_helpers import TokenDataset, make_trainer, tiny_gpt2  # noqa: E402

from lightning_dp.audit.hf import HFGradientCanaryAudit  # noqa: E402
from lightning_dp.hf import PrivacyArguments  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def test_hf_audit_observes_every_step_and_stays_below_the_reported_epsilon(tmp_path):
    model = tiny_gpt2()
    privacy = PrivacyArguments(noise_multiplier=1.0, dp_seed=0)
    trainer = make_trainer(model, tmp_path, TokenDataset(n=64), privacy=privacy, args=dict(max_steps=20))
    audit = HFGradientCanaryAudit(trainer, 500, seed=0)
    trainer.add_callback(audit)
    trainer.train()
    assert audit.canaries.steps_observed == trainer.privacy_engine.steps == 20
    report = audit.report()
    assert report.audit.num_canaries == 500 and np.isfinite(report.audit.epsilon_lower_bound)
    assert report.audit.epsilon_lower_bound < report.reported_epsilon


def test_hf_canaries_enter_before_the_division_by_the_expected_batch_size(tmp_path):
    # Without noise, an IN canary adds C / (q N) to its coordinate at every step it is sampled: IN minus OUT means
    # of the scores separate by C / (q N) * q * T = C T / N on average.
    privacy = PrivacyArguments(noise_multiplier=0.0, per_sample_max_grad_norm=1.0, dp_seed=0)
    trainer = make_trainer(tiny_gpt2(), tmp_path, TokenDataset(n=64), privacy=privacy, args=dict(max_steps=20))
    audit = HFGradientCanaryAudit(trainer, 2000, seed=0)
    trainer.add_callback(audit)
    trainer.train()
    scores, included = audit.canaries.scores, audit.canaries.included.numpy()
    assert scores[included].mean() - scores[~included].mean() == pytest.approx(20 / 64, rel=0.2)
