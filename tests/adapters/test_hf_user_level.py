"""User-level privacy with DPTrainer (``PrivacyArguments(privacy_unit="user", user_key=...)``): the user column of a
``datasets.Dataset`` is read from the training set as given (the Trainer's loader has removed it, as a column the
model does not take), the run is accounted over users, the batch-independence checks run on the users' rows, and
with one example per user the run is the example-level run exactly."""

from __future__ import annotations

import logging

import pytest

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

import torch  # noqa: E402
from hf_helpers import VOCAB, tiny_bert_classifier, trainable_snapshot, training_args  # noqa: E402

from lightning_dp.data.users import UserDataset  # noqa: E402
from lightning_dp.hf import DPTrainer, PrivacyArguments  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _model() -> torch.nn.Module:
    """The tiny BERT classifier without dropout (runs to compare see the same forwards)."""
    model = tiny_bert_classifier()
    model.config.hidden_dropout_prob = model.config.attention_probs_dropout_prob = 0.0
    weights = model.state_dict()
    model = type(model)(model.config)
    model.load_state_dict(weights)
    return model


def _dataset(users: list[int], seq: int = 6, seed: int = 0) -> datasets.Dataset:
    """Token sequences with a learnable label (``ids[0] % 2``) and a ``user`` column."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (len(users), seq), generator=generator)
    return datasets.Dataset.from_dict(
        {
            "input_ids": ids.tolist(),
            "attention_mask": torch.ones_like(ids).tolist(),
            "labels": (ids[:, 0] % 2).tolist(),
            "user": users,
        }
    )


def _privacy(**options) -> PrivacyArguments:
    defaults = dict(noise_multiplier=1.0, per_sample_max_grad_norm=0.5, accountant="rdp", dp_seed=0)
    return PrivacyArguments(**{**defaults, **options})


def _train(tmp_path, dataset, privacy: PrivacyArguments, **args) -> tuple[DPTrainer, torch.nn.Module]:
    model = _model()
    trainer = DPTrainer(
        model=model,
        args=training_args(tmp_path, optim="sgd", **{"per_device_train_batch_size": 4, "max_steps": 3, **args}),
        train_dataset=dataset,
        privacy_args=privacy,
    )
    trainer.train()
    return trainer, model


#: 12 users (ids 100.. in order of first appearance) with 1 to 4 examples each, interleaved.
USERS = [100 + u for k in range(4) for u in range(12) if 1 + u % 4 > k]


def test_dp_trainer_samples_clips_and_accounts_users(tmp_path, caplog, monkeypatch) -> None:
    from lightning_dp.checks import guard

    checks: list[tuple[str, int, int | None, bool]] = []  # (check, users, rows per user, conclusive)
    independence, leave_half_out = guard.check_batch_independence, guard.check_leave_half_out

    def batch_independence(loss, targets, copies=1):
        conclusive = independence(loss, targets, copies)
        checks.append(("independence", loss.shape[0], copies, conclusive))
        return conclusive

    def half_out(compute_loss, batch, batch_size, module):
        conclusive = leave_half_out(compute_loss, batch, batch_size, module)
        checks.append(("leave_half_out", batch_size, batch["weights"].shape[1], conclusive))
        return conclusive

    monkeypatch.setattr(guard, "check_batch_independence", batch_independence)
    monkeypatch.setattr(guard, "check_leave_half_out", half_out)
    dataset = _dataset(USERS)
    assert len(dataset) == 30
    privacy = _privacy(privacy_unit="user", user_key="user", examples_per_user=3)
    before = trainable_snapshot(_model())
    with caplog.at_level(logging.INFO, logger="lightning_dp"):
        trainer, model = _train(tmp_path, dataset, privacy)
    engine = trainer.privacy_engine
    summary = engine.summary()
    assert summary["privacy_unit"] == "user" and summary["num_users"] == 12 and summary["examples_per_user"] == 3
    assert summary["sample_rate"] == pytest.approx(4 / 12) and summary["steps"] == 3
    assert summary["delta"] == pytest.approx(1 / 12**1.1)
    assert 0 < summary["epsilon"] < float("inf")
    assert "user" in trainer.train_dataset.column_names  # the training set as given is left alone
    regrouped = engine.state.user_data
    assert isinstance(regrouped, UserDataset) and regrouped.users == list(range(100, 112))
    assert regrouped.counts.tolist() == [1 + u % 4 for u in range(12)]
    after = trainable_snapshot(model)
    assert any(not torch.equal(after[name], value) for name, value in before.items())
    # both checks ran once, conclusively, on a batch of users whose rows they grouped by 3, and nothing was said
    # about a check that could not run
    assert [(name, copies, conclusive) for name, _, copies, conclusive in checks] == [
        ("independence", 3, True),
        ("leave_half_out", 3, True),
    ]
    assert all(users >= 2 for _, users, _, _ in checks)
    assert engine.rows_per_unit == 3  # the clipper folded each user's 3 rows into one unit
    for phrase in ("could not run", "could not be read", "checks nothing", "is NOT checked"):
        assert phrase not in caplog.text
    assert "N (users)" in caplog.text and "user (column 'user'): a sampled user brings at most 3" in caplog.text


def test_one_example_per_user_trains_exactly_as_example_level(tmp_path) -> None:
    """Each user with one example: the same Poisson masks (N and q alike), one row per user with weight 1 and the
    same noise give the parameters of the example-level run."""
    dataset = _dataset(list(range(16)), seed=1)
    states = []
    for options in ({}, {"privacy_unit": "user", "user_key": "user"}):
        _, model = _train(tmp_path / str(len(options)), dataset, _privacy(**options))
        states.append(trainable_snapshot(model))
    for name, value in states[0].items():
        torch.testing.assert_close(states[1][name], value, rtol=1e-5, atol=1e-6, msg=name)
    initial = trainable_snapshot(_model())
    assert any(not torch.equal(value, initial[name]) for name, value in states[0].items())


def test_a_missing_user_column_is_refused_with_its_name(tmp_path) -> None:
    with pytest.raises(ValueError, match="user_key='author': example 0 has no such column"):
        _train(tmp_path, _dataset(USERS), _privacy(privacy_unit="user", user_key="author"))


def test_the_user_options_parse_from_the_command_line() -> None:
    (privacy,) = transformers.HfArgumentParser(PrivacyArguments).parse_args_into_dataclasses(
        ["--noise_multiplier", "1.0", "--privacy_unit", "user", "--user_key", "author", "--examples_per_user", "8"]
    )
    config = privacy.to_config()
    assert (config.privacy_unit, config.user_key, config.examples_per_user) == ("user", "author", 8)
    with pytest.raises(ValueError, match="privacy_unit='user' needs user_key"):
        transformers.HfArgumentParser(PrivacyArguments).parse_args_into_dataclasses(
            ["--noise_multiplier", "1.0", "--privacy_unit", "user"]
        )
