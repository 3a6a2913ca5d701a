"""A plain training script with no logging set-up, started by ``tests/engine/test_startup.py``.

Usage: ``python startup_script.py hf|lightning``. ``hf``: ``DPTrainer`` on a tiny GPT-2 (N = 32, per-device batch 4,
2 micro-batches, 2 steps); ``lightning``: ``DPStrategy`` on a tiny regressor (N = 64, batch 8, 2 micro-batches, 4
steps) with ``TrainingProgress`` every 2 steps. Both calibrate the noise for epsilon 3 with every other privacy
default. At the end the engine's own numbers go to stdout as one JSON line, to compare with the start-up block.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from lightning_dp.engine.privacy_engine import PrivacyEngine

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers


def train_hf(out: str) -> PrivacyEngine:
    from hf_helpers import TokenDataset, make_trainer, tiny_gpt2

    from lightning_dp.hf import PrivacyArguments

    privacy = PrivacyArguments(target_epsilon=3.0, dp_seed=0)
    args = dict(gradient_accumulation_steps=2, max_steps=2, logging_steps=1)
    trainer = make_trainer(tiny_gpt2(), out, TokenDataset(n=32), privacy=privacy, args=args)
    trainer.train()
    return trainer.privacy_engine


def train_lightning(out: str) -> PrivacyEngine:
    from helpers import TinyRegressor, make_trainer

    from lightning_dp import DPStrategy, TrainingProgress

    strategy = DPStrategy(target_epsilon=3.0, max_grad_norm=1.0, seed=0)
    trainer = make_trainer(
        strategy,
        max_steps=4,
        accumulate_grad_batches=2,
        log_every_n_steps=2,
        callbacks=[TrainingProgress()],
        default_root_dir=out,
    )
    trainer.fit(TinyRegressor())
    return strategy.privacy_engine


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as out:
        engine = {"hf": train_hf, "lightning": train_lightning}[sys.argv[1]](out)
    facts = {
        "q": engine.sample_rate,
        "N": engine.num_samples,
        "planned_steps": engine.planned_steps,
        "noise_multiplier": engine.mechanism.noise_multiplier,
        "delta": engine.target_delta,
        "accountant": engine.accountant.name,
    }
    print(json.dumps(facts))
