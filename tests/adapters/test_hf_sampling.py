"""``DPTrainer`` and the Trainer's ``train_sampling_strategy``: ``group_by_length`` splits each Poisson batch into
micro-batches of similar lengths (less padding, the same step), other strategies are ignored with a warning."""

from __future__ import annotations

import logging

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from hf_helpers import VOCAB, tiny_gpt2, training_args  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from lightning_dp.hf import DPTrainer, PrivacyArguments  # noqa: E402
from lightning_dp.hf.sampling import poisson_batch_lengths, sampling_strategy  # noqa: E402


class VariableLengthTokens(Dataset):
    """``n`` token sequences of lengths 2 to 12 (LM labels = ids)."""

    def __init__(self, n: int = 48) -> None:
        gen = torch.Generator().manual_seed(0)
        lengths = torch.randint(2, 13, (n,), generator=gen)
        self.ids = [torch.randint(1, VOCAB, (int(t),), generator=gen) for t in lengths]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def pad_per_batch(examples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pads to the batch's longest example (pad id 0, label -100, attention mask 0); records the padded size."""
    width = max(len(e["input_ids"]) for e in examples)
    batch = {"input_ids": [], "attention_mask": [], "labels": []}
    for example in examples:
        pad = width - len(example["input_ids"])
        batch["input_ids"].append(torch.cat([example["input_ids"], torch.zeros(pad, dtype=torch.long)]))
        batch["attention_mask"].append(torch.cat([torch.ones(width - pad), torch.zeros(pad)]).long())
        batch["labels"].append(torch.cat([example["labels"], torch.full((pad,), -100)]))
    PADDED_TOKENS.append(len(examples) * width)
    return {k: torch.stack(v) for k, v in batch.items()}


PADDED_TOKENS: list[int] = []


def train(tmp_path, strategy: str) -> tuple[dict[str, torch.Tensor], int, DPTrainer]:
    """Three noisy steps of a float64 GPT-2 without dropout (expected batch 24 = 6 x 4 micro-batches); the
    parameters after them and the tokens the micro-batches carried, padding included."""
    PADDED_TOKENS.clear()
    model = tiny_gpt2()
    model.config.resid_pdrop = model.config.embd_pdrop = model.config.attn_pdrop = 0.0  # no batch-dependent masks
    model = type(model)(model.config).double()
    trainer = DPTrainer(
        model=model,
        args=training_args(
            tmp_path / strategy,
            per_device_train_batch_size=6,
            gradient_accumulation_steps=4,
            max_steps=3,
            train_sampling_strategy=strategy,
        ),
        train_dataset=VariableLengthTokens(),
        data_collator=pad_per_batch,
        privacy_args=PrivacyArguments(noise_multiplier=1.0, per_sample_max_grad_norm=0.5, accountant="rdp", dp_seed=7),
    )
    trainer.train()
    parameters = {name: p.detach().clone() for name, p in model.named_parameters()}
    return parameters, sum(PADDED_TOKENS), trainer


def test_group_by_length_takes_the_same_steps_with_less_padding(tmp_path) -> None:
    plain, plain_tokens, _ = train(tmp_path, "random")
    grouped, grouped_tokens, trainer = train(tmp_path, "group_by_length")
    # the same Poisson samples, the same clipped sums and the same noise: the same parameters (float64 round-off)
    for name, value in plain.items():
        torch.testing.assert_close(grouped[name], value, rtol=0, atol=1e-12, msg=name)
    assert grouped_tokens < 0.85 * plain_tokens  # micro-batches of similar lengths pad less
    assert trainer.privacy_engine.length_grouped
    startup = "\n".join(trainer.privacy_engine.startup_lines())
    assert "4 micro-batch(es) per step, grouped by length" in startup


def test_lengths_come_from_the_length_column_or_the_model_input(tmp_path) -> None:
    datasets = pytest.importorskip("datasets")
    args = training_args(tmp_path, train_sampling_strategy="group_by_length", gradient_accumulation_steps=2)
    with_column = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4]], "length": [7, 9]})
    assert poisson_batch_lengths(args, with_column, None) == [7, 9]  # the column, as the Trainer reads it
    assert poisson_batch_lengths(args, VariableLengthTokens(3), None) == [len(x) for x in VariableLengthTokens(3).ids]
    assert poisson_batch_lengths(training_args(tmp_path), with_column, None) is None  # "random": no grouping
    one_micro_batch = training_args(tmp_path, train_sampling_strategy="group_by_length")
    assert poisson_batch_lengths(one_micro_batch, with_column, None) is None  # nothing to group
    assert sampling_strategy(training_args(tmp_path)) == "random"


def test_the_trainer_reads_the_length_column_its_loader_drops(tmp_path) -> None:
    """A ``datasets.Dataset`` with a length column: the Trainer's loader removes the column (the model does not take
    it), the Poisson sampler still groups by it."""
    datasets = pytest.importorskip("datasets")
    ids = VariableLengthTokens(12).ids
    stated = list(range(12, 0, -1))  # not the token counts: proves the column is what is read
    dataset = datasets.Dataset.from_dict(
        {"input_ids": [x.tolist() for x in ids], "labels": [x.tolist() for x in ids], "length": stated}
    ).with_format("torch")
    trainer = DPTrainer(
        model=tiny_gpt2(),
        args=training_args(
            tmp_path,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            train_sampling_strategy="group_by_length",
        ),
        train_dataset=dataset,
        data_collator=pad_per_batch,
        privacy_args=PrivacyArguments(noise_multiplier=1.0, accountant="rdp"),
    )
    loader = trainer.get_train_dataloader()
    assert loader.batch_sampler.lengths.tolist() == stated
    assert "length" not in next(iter(loader))  # the column itself does not reach the model


@pytest.mark.parametrize("strategy", ["sequential", "batch_rebalance"])
def test_strategies_poisson_sampling_cannot_keep_are_ignored_with_a_warning(strategy, tmp_path, caplog) -> None:
    args = training_args(tmp_path, train_sampling_strategy=strategy)
    with caplog.at_level(logging.WARNING, logger="lightning_dp"):
        assert poisson_batch_lengths(args, VariableLengthTokens(3), None) is None
    assert f"train_sampling_strategy='{strategy}' is ignored under DP" in caplog.text
