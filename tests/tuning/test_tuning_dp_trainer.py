"""A private search whose candidates are ``DPTrainer`` runs (docs/tuning.md, "With the HF Trainer"): each candidate
trains with the plan's noise multiplier, sample rate and steps (its own ledger is the plan's event, ``check_spent``, and
gives the plan's per-candidate epsilon),
with its drawn learning rate and clipping bound, and only the winner's saved model is left, loadable by
``from_pretrained``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import transformers
from hf_helpers import TokenDataset, make_trainer, tiny_bert_classifier

from lightning_dp.hf import PrivacyArguments
from lightning_dp.tuning import Candidate, RepetitionDistribution, SearchPlan, private_search

SPACE = {"lr": [0.01, 0.1, 0.5], "max_grad_norm": [0.5, 1.0]}
DELTA = 1e-5


def test_a_search_over_dp_trainer_candidates_releases_the_winner_only(tmp_path: Path) -> None:
    plan = SearchPlan(1.0, 0.25, 3, DELTA, RepetitionDistribution(mean=3, shape=1))
    runs = tmp_path / "runs"
    trained: list[dict] = []

    def train_candidate(candidate: Candidate) -> tuple[float, Path]:
        folder = runs / str(len(trained))
        privacy = PrivacyArguments(
            noise_multiplier=candidate.noise_multiplier,
            sample_rate=candidate.sample_rate,
            per_sample_max_grad_norm=candidate.hparams["max_grad_norm"],
            accountant="rdp",
            dp_seed=candidate.seed,
        )
        trainer = make_trainer(
            tiny_bert_classifier(),
            folder,
            TokenDataset(n=16, task="cls"),
            privacy=privacy,
            eval_dataset=TokenDataset(n=8, task="cls", seed=1),  # the split declared public
            args={"learning_rate": candidate.hparams["lr"], "max_steps": candidate.steps},
        )
        trainer.train()
        candidate.check_spent(trainer.privacy_engine)  # the run's ledger is the plan's event, steps times
        score = trainer.evaluate()["eval_loss"]
        trained.append(
            {
                "epsilon": trainer.get_epsilon(DELTA),
                "lr": trainer.args.learning_rate,
                "bound": trainer.privacy_args.per_sample_max_grad_norm,
                "steps": trainer.state.global_step,
                "hparams": candidate.hparams,
                "score": score,
                "seed": candidate.seed,
            }
        )
        trainer.save_model(str(folder / "model"))
        return score, folder / "model"

    result = private_search(train_candidate, SPACE, plan, tmp_path / "search", seed=3, higher_is_better=False)

    assert len(trained) >= 2, "the seeded draw must run a loser too"
    for run in trained:  # each candidate is the run the plan accounts for, with its drawn hyper-parameters
        assert run["epsilon"] == pytest.approx(plan.candidate_epsilon, rel=1e-9)
        assert run["steps"] == plan.steps
        assert (run["lr"], run["bound"]) == (run["hparams"]["lr"], run["hparams"]["max_grad_norm"])
    assert len({run["seed"] for run in trained}) == len(trained)  # independent runs
    best = min(trained, key=lambda run: run["score"])
    assert result.hparams == best["hparams"] and result.score == best["score"]
    assert result.epsilon == plan.epsilon and math.isfinite(result.epsilon)
    assert isinstance(result.artifact, Path) and result.artifact.parent == result.output_dir
    model = transformers.BertForSequenceClassification.from_pretrained(result.artifact)
    assert model.config.num_labels == 2
    assert not any(runs.glob("*/model"))  # the winner's folder was moved, the losers' deleted
