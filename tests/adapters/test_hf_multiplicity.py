"""Augmentation multiplicity with DPTrainer (De et al. 2022, Section 3.2): DPTrainer makes the K copies of each
collated example and a subclass's ``augment_copies`` augments them (only in train mode); identical copies train
exactly as K = 1; without ``augment_copies`` the option is refused at construction."""

from __future__ import annotations

from typing import Any

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from hf_helpers import TokenDataset, make_trainer, tiny_bert_classifier, trainable_snapshot, training_args  # noqa: E402

from lightning_dp import augment_each_example  # noqa: E402
from lightning_dp.hf import DPTrainer, PrivacyArguments  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
K = 3


class TokenDroppingTrainer(DPTrainer):
    """Masks one random position of every copy (its attention mask set to 0): each row on its own, from torch's
    global RNG (as augment_copies's docstring advises); records what it saw."""

    calls: list[tuple[int, bool]]

    def augment_copies(self, inputs: dict[str, Any]) -> dict[str, Any]:
        self.calls.append((inputs["input_ids"].shape[0], self.model.training))
        mask = inputs["attention_mask"].clone()
        rows = torch.arange(mask.shape[0])
        mask[rows, torch.randint(1, mask.shape[1], (mask.shape[0],), device=mask.device)] = 0
        return {**inputs, "attention_mask": mask}


class IdentityTrainer(DPTrainer):
    """Leaves the copies as they are (identical copies)."""

    calls: list[tuple[int, bool]]

    def augment_copies(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return inputs


def _privacy(copies: int) -> PrivacyArguments:
    return PrivacyArguments(
        noise_multiplier=1.0,
        per_sample_max_grad_norm=0.05,
        accountant="rdp",
        dp_seed=0,
        augmentation_multiplicity=copies,
    )


def _model() -> torch.nn.Module:
    """The tiny BERT classifier without dropout (copies of one example then have one gradient)."""
    model = tiny_bert_classifier()
    model.config.hidden_dropout_prob = model.config.attention_probs_dropout_prob = 0.0
    weights = model.state_dict()
    model = type(model)(model.config)
    model.load_state_dict(weights)
    return model


def _train(trainer_cls: type[DPTrainer], copies: int, tmp_path) -> tuple[DPTrainer, torch.nn.Module]:
    model = _model()
    trainer_cls.calls = []
    trainer = trainer_cls(
        model=model,
        args=training_args(tmp_path, optim="sgd"),
        train_dataset=TokenDataset(n=32, task="cls"),
        privacy_args=_privacy(copies),
    )
    trainer.train()
    return trainer, model


def test_augmented_copies_train_and_report(tmp_path) -> None:
    """``augment_copies`` sees the B K rows of every micro-batch, in train mode only (the leave-half-out check's
    eval-mode forwards get the copies unaugmented); the run trains and reports K."""
    trainer, model = _train(TokenDroppingTrainer, K, tmp_path)
    assert trainer.calls and all(rows % K == 0 and training for rows, training in trainer.calls)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), _model().parameters(), strict=True))
    summary = trainer.privacy_engine.summary()
    assert summary["augmentation_multiplicity"] == K and 0 < summary["epsilon"] < float("inf")


def test_identical_copies_train_exactly_as_one_copy(tmp_path) -> None:
    """Without augmentation the average of K equal gradients is the gradient: the same Poisson batches, clip
    factors and noise give the parameters of K = 1 (up to float rounding)."""
    states = []
    for trainer_cls, copies in ((DPTrainer, 1), (IdentityTrainer, K)):
        _, model = _train(trainer_cls, copies, tmp_path / str(copies))
        states.append(trainable_snapshot(model))
    for name, value in states[0].items():
        torch.testing.assert_close(states[1][name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_copies_without_augment_copies_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="augmentation_multiplicity=3: DPTrainer makes 3 copies .* augment_copies"):
        make_trainer(tiny_bert_classifier(), tmp_path, privacy=_privacy(K))


class CopyMajorTrainer(DPTrainer):
    """Augments copy k of every example at once and concatenates: copy-major rows (the review's reproduction)."""

    calls: list[tuple[int, bool]]

    def augment_copies(self, inputs: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for key, value in inputs.items():
            parts = [value[k::K].clone() for k in range(K)]
            if key == "input_ids":
                for part in parts:
                    part[:, 1] = torch.randint(1, 20, (part.shape[0],), device=part.device)
            out[key] = torch.cat(parts)
        return out


class MovedIdsTrainer(DPTrainer):
    """Keeps the labels but moves the input ids across examples (integer inputs: no gradient to see)."""

    calls: list[tuple[int, bool]]

    def augment_copies(self, inputs: dict[str, Any]) -> dict[str, Any]:
        ids = inputs["input_ids"]
        return {**inputs, "input_ids": torch.cat([ids[k::K] for k in range(K)])}


class PerExampleTrainer(DPTrainer):
    """Token substitution through lightning_dp.augment_each_example, from torch's global RNG (per-sample momentum's
    re-runs see the same copies)."""

    calls: list[tuple[int, bool]]

    def augment_copies(self, inputs: dict[str, Any]) -> dict[str, Any]:
        def substitute(copies: dict[str, Any]) -> dict[str, Any]:
            ids = copies["input_ids"]
            noise = torch.randint(1, 50, ids.shape, device=ids.device)
            return {**copies, "input_ids": torch.where(torch.rand(ids.shape, device=ids.device) < 0.3, noise, ids)}

        return augment_each_example(inputs, K, substitute)


@pytest.mark.parametrize("trainer_cls", [CopyMajorTrainer, MovedIdsTrainer])
def test_rows_moved_across_examples_are_refused(trainer_cls, tmp_path) -> None:
    """A reordering done only in train mode on integer inputs passes the checks (no input gradient; leave-half-out
    runs in eval mode): DPTrainer compares the returned rows with the repeated batch."""
    with pytest.raises(ValueError, match="augment_copies must keep each row in place"):
        _train(trainer_cls, K, tmp_path)


def test_augment_each_example_with_momentum_trains(tmp_path) -> None:
    """augment_each_example from torch's global RNG: the run (with per-sample momentum's re-runs) trains."""
    PerExampleTrainer.calls = []
    trainer = PerExampleTrainer(
        model=_model(),
        args=training_args(tmp_path, optim="sgd"),
        train_dataset=TokenDataset(n=32, task="cls"),
        privacy_args=PrivacyArguments(
            noise_multiplier=1.0,
            per_sample_max_grad_norm=0.05,
            accountant="rdp",
            dp_seed=0,
            augmentation_multiplicity=K,
            momentum_length=2,
        ),
    )
    trainer.train()
    assert trainer.privacy_engine.summary()["augmentation_multiplicity"] == K


def test_disable_dp_warns_that_copies_are_ignored(tmp_path, caplog) -> None:
    privacy = PrivacyArguments(disable_dp=True, noise_multiplier=1.0, augmentation_multiplicity=K)
    with caplog.at_level("WARNING", logger="lightning_dp"):
        IdentityTrainer(model=_model(), args=training_args(tmp_path, optim="sgd"), privacy_args=privacy)
    assert "augmentation_multiplicity=3 is ignored" in caplog.text
