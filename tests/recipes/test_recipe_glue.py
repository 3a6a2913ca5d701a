"""The GLUE recipe (lightning_dp/recipes/glue.py): the entry point users run on a tiny model, the same run twice
with the same seed, the metric on hand-made predictions, the data (local SST-2 and the QNLI split of the test
subsets, the Hub path of every task with a stand-in ``load_dataset``), early failures on bad input, the Hub config,
and (slow) the full local copies and the docs configuration."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from recipe_helpers import FULL_DATA, ROOT, TEST_DATA, needs_full_data, script_env
from transformers import GPT2Config, RobertaConfig, Trainer, TrainingArguments, ViTConfig
from transformers.trainer_utils import PredictionOutput

from lightning_dp.hf import PrivacyArguments
from lightning_dp.recipes import config, glue
from lightning_dp.tasks.local_data import LocalDataError

SCRIPT = ROOT / "recipes" / "glue.py"
DOCS_CONFIG = ROOT / "configs" / "glue_offline.yaml"
HUB_CONFIG = ROOT / "configs" / "glue_hub.yaml"
#: The GLUE recipe on the test subsets (``tests/data/glue``).
LOCAL = ["--config", str(DOCS_CONFIG), "--data_dir", str(TEST_DATA)]


def run_script(*flags: str, timeout: int = 600) -> dict:
    """Run ``recipes/glue.py`` as users do (a subprocess) and return its results.json."""
    completed = subprocess.run(
        [sys.executable, str(SCRIPT), *flags],
        cwd=ROOT,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = [flags[i + 1] for i, flag in enumerate(flags) if flag == "--results_file"]
    return json.loads(Path(results[0]).read_text())


def returns_of(monkeypatch, module, name: str) -> list:
    """The values ``module.name`` returns from now on (patched to record them), in call order."""
    returned = []
    function = getattr(module, name)

    def recorded(*args, **kwargs):
        returned.append(function(*args, **kwargs))
        return returned[-1]

    monkeypatch.setattr(module, name, recorded)
    return returned


# --- entry point ---------------------------------------------------------------------------------------------------


def test_smoke_docs_config_on_a_tiny_model(tmp_path):
    result = run_script(
        *LOCAL, "--tiny_model", "true", "--train_size", "32", "--eval_size", "16",
        "--max_steps", "2", "--per_device_train_batch_size", "8", "--accountant", "rdp",
        "--output_dir", str(tmp_path), "--results_file", str(tmp_path / "results.json"),
    )  # fmt: skip
    assert set(result["metrics"]) == {"accuracy"}
    assert 0 <= result["metrics"]["accuracy"] <= 100
    assert math.isfinite(result["privacy"]["epsilon"]) and 0 < result["privacy"]["epsilon"] <= 3.0 + 1e-6
    assert result["privacy"]["noise"] == "gaussian" and result["privacy"]["clipping"] == "mixed"
    assert result["privacy"]["accountant"] == "rdp"  # the docs config's PLD takes minutes at this q and delta
    assert result["steps"] == 2 and result["train_size"] == 32 and result["eval_size"] == 16
    assert result["arguments"]["recipe"]["task"] == "sst2"


def test_pad_to_max_length_gives_the_collator_a_fixed_length(tmp_path, monkeypatch):
    """``--pad_to_max_length true``: every training batch is padded to ``max_length`` (docs/privacy.md, "What is not
    covered")."""
    from transformers import DataCollatorWithPadding

    batches, call = [], DataCollatorWithPadding.__call__

    def recorded(collator, rows):
        batch = call(collator, rows)
        batches.append((collator.padding, collator.max_length, batch["input_ids"].shape[1]))
        return batch

    monkeypatch.setattr(DataCollatorWithPadding, "__call__", recorded)
    result = glue.main(
        [*LOCAL, "--tiny_model", "true", "--pad_to_max_length", "true", "--max_length", "40", "--train_size", "16",
         "--eval_size", "8", "--max_steps", "1", "--per_device_train_batch_size", "4", "--accountant", "rdp",
         "--output_dir", str(tmp_path), "--results_file", str(tmp_path / "r.json")]
    )  # fmt: skip
    assert result["steps"] == 1 and result["arguments"]["recipe"]["pad_to_max_length"] is True
    assert batches and set(batches) == {("max_length", 40, 40)}


@pytest.mark.parametrize("switch", [["--dp", "false"], ["--disable_dp", "true"]], ids=["dp false", "disable_dp"])
def test_qnli_pairs_without_dp_in_process(tmp_path, switch):
    """Sentence pairs, the plain Trainer, the CLS head with the top layer trained (no LoRA); either switch."""
    result = glue.main(
        [*LOCAL, "--task", "qnli", "--tiny_model", "true", "--pooling", "cls",
         "--lora_rank", "0", "--train_layers", "1", *switch, "--train_size", "16", "--eval_size", "8",
         "--max_steps", "1", "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path),
         "--results_file", str(tmp_path / "r.json")]
    )  # fmt: skip
    assert result["privacy"] is None and result["dp"] is False and result["steps"] == 1
    assert set(result["metrics"]) == {"accuracy"}
    environment = result["environment"]  # what small-run numbers depend on besides the command and seed
    assert environment["threads"] == torch.get_num_threads() and environment["torch"] == torch.__version__
    assert environment["cpu_capability"] == torch.backends.cpu.get_cpu_capability()


def test_lora_on_query_value_trains_adapters_and_head_only(tmp_path):
    """LoRA (peft, SEQ_CLS) on the mean-pooling BERT classifier, trained with DP for one step in-process."""
    recipe = glue.GlueArguments(tiny_model=True, pooling="mean", lora_rank=2, lora_layers=1, train_layers=0)
    model = glue.load_model(recipe, num_labels=2)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in name or "classifier" in name for name in names), names
    assert all(".layer.1." in name for name in names if "lora_" in name)  # the top layer of the tiny model's 2
    result = glue.main(
        [*LOCAL, "--tiny_model", "true", "--lora_rank", "2", "--lora_layers", "1",
         "--train_size", "16", "--eval_size", "8", "--max_steps", "1", "--per_device_train_batch_size", "4",
         "--accountant", "rdp", "--output_dir", str(tmp_path), "--results_file", str(tmp_path / "r.json")]
    )  # fmt: skip
    assert result["trainable_params"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert math.isfinite(result["privacy"]["epsilon"])


def test_same_seed_same_run(tmp_path, monkeypatch):
    """The same command twice in one process (so the generators' state differs between the two): the recipe seeds
    them before building the classifier, so the new head starts, trains and scores the same."""
    models = returns_of(monkeypatch, glue, "load_model")
    torch.manual_seed(12345)  # whatever ran before: the recipe must not depend on it
    results = []
    for run_index in range(2):
        results.append(
            glue.main(
                [*LOCAL, "--tiny_model", "true", "--train_size", "32", "--eval_size", "32", "--max_steps", "2",
                 "--per_device_train_batch_size", "8", "--accountant", "rdp", "--output_dir", str(tmp_path),
                 "--results_file", str(tmp_path / f"r{run_index}.json")]
            )
        )  # fmt: skip
        torch.rand(7)  # moves the global generator on between the runs
    assert results[0]["metrics"] == results[1]["metrics"]
    assert results[0]["privacy"] == results[1]["privacy"]
    first, second = (dict(model.named_parameters()) for model in models)
    trained = [name for name, p in first.items() if p.requires_grad]
    assert trained and all("classifier" in name for name in trained)
    for name, parameter in first.items():
        assert torch.equal(parameter, second[name]), name


def test_head_learning_rate_trains_the_head_at_its_own_rate_and_the_history_is_recorded(tmp_path, monkeypatch):
    """LoRA at learning_rate, the classifier at head_learning_rate (peft's trainable copy of the head), both decayed
    by the Trainer's scheduler; the run's log rows (loss, epsilon, the periodic evaluation's accuracy) are kept in
    results.json."""
    optimizers = returns_of(monkeypatch, glue, "head_optimizer")
    result = glue.main(
        [*LOCAL, "--tiny_model", "true", "--lora_rank", "2", "--learning_rate", "1e-3", "--head_learning_rate", "0.5",
         "--weight_decay", "0.1", "--train_size", "32", "--eval_size", "16", "--max_steps", "2",
         "--per_device_train_batch_size", "8", "--accountant", "rdp", "--eval_strategy", "steps", "--eval_steps", "1",
         "--lr_scheduler_type", "constant", "--logging_steps", "1", "--train_sampling_strategy", "group_by_length",
         "--output_dir", str(tmp_path), "--results_file", str(tmp_path / "r.json")]
    )  # fmt: skip
    (optimizer,) = optimizers
    rates = {
        (group["lr"], group["weight_decay"]): sum(p.numel() for p in group["params"])
        for group in optimizer.param_groups
    }
    assert set(rates) == {(1e-3, 0.1), (0.5, 0.1), (0.5, 0.0)}  # LoRA matrices; the head's weight and its bias
    assert sum(rates.values()) == result["trainable_params"]
    history = result["history"]
    assert [row["step"] for row in history if "loss" in row] == [1, 2]
    assert all(row["epsilon"] > 0 for row in history if "loss" in row)
    assert [row["step"] for row in history if "eval_accuracy" in row] == [1, 2]
    assert result["metrics"]["accuracy"] == pytest.approx(history[-2]["eval_accuracy"])  # the same model and split
    with pytest.raises(ValueError, match="head_learning_rate must be > 0"):
        glue.GlueArguments(head_learning_rate=0.0)
    frozen_head = glue.load_model(glue.GlueArguments(tiny_model=True, pooling="mean"), num_labels=2)
    frozen_head.classifier.requires_grad_(False)
    with pytest.raises(ValueError, match="needs a trainable classifier module"):
        glue.head_optimizer(frozen_head, TrainingArguments(output_dir=str(tmp_path)), 0.1)


def test_the_final_metric_pairs_each_prediction_with_the_label_the_trainer_returns(tmp_path, monkeypatch):
    """The Trainer's evaluation sampler may reorder the examples (it groups them by length under group_by_length):
    a perfect classifier whose predictions come back in another order than the dataset's still scores 100."""

    def reordered_perfect_predictions(self, dataset, *args, **kwargs):
        labels = np.array([dataset[i]["labels"] for i in range(len(dataset))])[::-1]
        return PredictionOutput(predictions=np.eye(2)[labels], label_ids=labels, metrics={})

    monkeypatch.setattr(Trainer, "predict", reordered_perfect_predictions)
    result = glue.main(
        [*LOCAL, "--tiny_model", "true", "--dp", "false", "--train_size", "16", "--eval_size", "32", "--max_steps", "1",
         "--per_device_train_batch_size", "8", "--output_dir", str(tmp_path),
         "--results_file", str(tmp_path / "r.json")]
    )  # fmt: skip
    assert result["metrics"]["accuracy"] == 100.0


# --- metric --------------------------------------------------------------------------------------------------------


def test_accuracy_on_hand_made_logits():
    logits = np.array([[0.1, 0.9], [2.0, -1.0], [0.0, 1.0], [-3.0, 3.0]])  # predictions 1, 0, 1, 1
    assert glue.glue_metrics(logits, [1, 0, 0, 1], "sst2") == {"accuracy": 75.0}


def test_qqp_reports_f1_of_the_duplicate_class():
    logits = np.array([[0.1, 0.9], [2.0, -1.0], [0.0, 1.0], [-3.0, 3.0]])  # predictions 1, 0, 1, 1
    # duplicate (1): TP 2, FP 1, FN 0 -> precision 2/3, recall 1, F1 0.8
    result = glue.glue_metrics(logits, [1, 0, 0, 1], "qqp")
    assert result["accuracy"] == pytest.approx(75.0) and result["f1"] == pytest.approx(80.0)


def test_mnli_three_classes():
    logits = np.eye(3)[[0, 1, 2, 2, 1]]
    assert glue.glue_metrics(logits, [0, 1, 2, 0, 0], "mnli") == {"accuracy": pytest.approx(60.0)}


# --- data ----------------------------------------------------------------------------------------------------------


def test_local_sst2_reads_the_tsvs_in_place():
    train, evaluation = glue.load_examples(glue.GlueArguments(task="sst2", train_size=5, data_dir=str(TEST_DATA)))
    assert len(train) == 5 and len(evaluation) == 200  # the test subset's dev.tsv
    assert all(len(e.texts) == 1 and e.label in (0, 1) for e in train + evaluation)
    assert train[0].texts[0].startswith("hide new secretions")


@pytest.mark.parametrize("data_dir", ["glue", "glue/sst2"])
def test_local_data_dir_may_be_the_dataset_folder(data_dir):
    """``--data_dir`` is the data root, or the folder that holds the files (``glue/`` or ``glue/sst2/``)."""
    root = glue.load_examples(glue.GlueArguments(task="sst2", data_dir=str(TEST_DATA)))
    assert glue.load_examples(glue.GlueArguments(task="sst2", data_dir=str(TEST_DATA / data_dir))) == root


def test_local_qnli_split_is_deterministic_and_disjoint():
    train, evaluation = glue.load_examples(glue.GlueArguments(task="qnli", data_dir=str(TEST_DATA)))
    assert (len(train), len(evaluation)) == (200, 50)  # the first 80 % of the subset's 250 rows train
    assert train[0].texts[0] == "What came into force after the new constitution was herald?"
    assert train[0].label == 0 and train[1].label == 1  # entailment, not_entailment
    assert not {e.texts for e in train} & {e.texts for e in evaluation}
    again, _ = glue.load_examples(glue.GlueArguments(task="qnli", data_dir=str(TEST_DATA)))
    assert again == train


@pytest.mark.slow
@needs_full_data("glue/sst2/train_full.tsv", "glue/sst2/dev.tsv", "glue/qnli/dev.tsv")
def test_full_local_copies():
    train, evaluation = glue.load_examples(glue.GlueArguments(task="sst2", data_dir=str(FULL_DATA)))
    assert (len(train), len(evaluation)) == (67349, 872)
    train, evaluation = glue.load_examples(glue.GlueArguments(task="qnli", data_dir=str(FULL_DATA)))
    assert (len(train), len(evaluation)) == (4370, 1093)  # the GLUE QNLI dev set's 5,463 pairs, 80 % / 20 %


#: task -> (the Hub split read for evaluation, columns of a row as the Hub's nyu-mll/glue has them).
HUB_ROWS = {
    "sst2": ("validation", {"sentence": ["s1", "s2"]}),
    "qnli": ("validation", {"question": ["q1", "q2"], "sentence": ["s1", "s2"]}),
    "mnli": ("validation_matched", {"premise": ["p1", "p2"], "hypothesis": ["h1", "h2"]}),
    "qqp": ("validation", {"question1": ["a1", "a2"], "question2": ["b1", "b2"]}),
}


@pytest.mark.parametrize("task", sorted(HUB_ROWS))
def test_hub_path_uses_the_right_splits_and_columns(monkeypatch, task):
    datasets = pytest.importorskip("datasets")
    calls = []
    eval_split, columns = HUB_ROWS[task]

    def fake_load_dataset(name, subset, split):
        calls.append((name, subset, split))
        return datasets.Dataset.from_dict({**columns, "label": [1, 0], "idx": [0, 1]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    train, evaluation = glue.load_examples(glue.GlueArguments(task=task, data_source="hub", eval_size=1))
    assert calls == [("nyu-mll/glue", task, "train"), ("nyu-mll/glue", task, eval_split)]
    texts = list(zip(*columns.values(), strict=True))
    assert train == [glue.Example(texts[0], 1), glue.Example(texts[1], 0)]
    assert evaluation == [glue.Example(texts[0], 1)]


def test_evaluation_rows_ordered_by_length_keep_their_labels():
    class Tokenizer:
        def __call__(self, texts, truncation, max_length):
            ids = [[0] * len(t.split()) for t in texts]
            return {"input_ids": ids, "attention_mask": ids}

    examples = [glue.Example(("a b c",), 0), glue.Example(("a",), 1), glue.Example(("a b",), 0)]
    data = glue.GlueDataset(examples, Tokenizer(), 8, by_length=True)
    assert [len(data[i]["input_ids"]) for i in range(3)] == [1, 2, 3]
    assert data.labels == [1, 0, 0]


# --- bad input -----------------------------------------------------------------------------------------------------


def test_unknown_task_lists_the_supported_ones():
    with pytest.raises(ValueError, match="unknown GLUE task 'cola'; choose from sst2, qnli, mnli, qqp"):
        glue.main(["--config", str(DOCS_CONFIG), "--task", "cola"])


@pytest.mark.parametrize("task", ["mnli", "qqp"])
def test_tasks_without_a_local_copy_say_to_use_the_hub(task):
    with pytest.raises(ValueError, match="no local copy.*data_source: hub"):
        glue.load_examples(glue.GlueArguments(task=task))


def test_missing_local_data_folder_and_file(tmp_path, monkeypatch):
    monkeypatch.delenv("LIGHTNING_DP_DATA", raising=False)
    message = "no local data for glue/sst2: .*--data_dir.*LIGHTNING_DP_DATA.*configs/glue_hub.yaml"
    with pytest.raises(LocalDataError, match=message):
        glue.load_examples(glue.GlueArguments())
    with pytest.raises(FileNotFoundError, match="does not exist.*data_dir"):
        glue.load_examples(glue.GlueArguments(data_dir=str(tmp_path / "absent")))
    (tmp_path / "glue" / "sst2").mkdir(parents=True)
    (tmp_path / "glue" / "sst2" / "dev.tsv").write_text("sentence\tlabel\n")
    with pytest.raises(FileNotFoundError, match="no local copy of glue/sst2 .*train_full.tsv and dev.tsv"):
        glue.load_examples(glue.GlueArguments(data_dir=str(tmp_path)))


@pytest.mark.parametrize(
    ("model_config", "message"),
    [
        (GPT2Config(n_layer=1, n_embd=8, n_head=2, architectures=["GPT2LMHeadModel"]), "causal language model"),
        (ViTConfig(num_hidden_layers=1, hidden_size=8), "no sequence-classification head"),
    ],
)
def test_models_without_a_classification_head_fail_early(tmp_path, model_config, message):
    model_config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        glue.load_model(glue.GlueArguments(model_name_or_path=str(tmp_path)), num_labels=2)


def test_max_length_above_the_model_maximum_fails():
    with pytest.raises(ValueError, match="max_length 1024 exceeds the model's maximum of 512"):
        glue.load_model(glue.GlueArguments(max_length=1024, tiny_model=True), num_labels=2)


def test_mean_pooling_needs_a_bert_encoder(tmp_path):
    RobertaConfig(num_hidden_layers=1, hidden_size=8, num_attention_heads=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="pooling: mean is for BERT"):
        glue.load_model(glue.GlueArguments(model_name_or_path=str(tmp_path), pooling="mean"), num_labels=2)


def test_bad_trainable_choices_fail_when_parsed():
    with pytest.raises(ValueError, match="pooling must be one of cls, mean"):
        glue.GlueArguments(pooling="max")
    with pytest.raises(ValueError, match="train_layers > 0 applies without LoRA"):
        glue.GlueArguments(lora_rank=4, train_layers=1)
    with pytest.raises(ValueError, match="at most the model's 2 layers"):
        glue.load_model(glue.GlueArguments(tiny_model=True, train_layers=3), num_labels=2)


def test_train_layers_freezes_embeddings_and_lower_layers():
    model = glue.load_model(glue.GlueArguments(tiny_model=True, pooling="mean", train_layers=1), num_labels=2)
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    assert all(name.startswith(("bert.encoder.layer.1.", "classifier.")) for name in names), names
    assert any(name.startswith("classifier.") for name in names)


# --- configs -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [DOCS_CONFIG, HUB_CONFIG])
def test_configs_parse_into_the_dataclasses(path):
    recipe, training, privacy = config.parse_recipe_args(
        (glue.GlueArguments, TrainingArguments, PrivacyArguments), ["--config", str(path)]
    )
    assert isinstance(recipe, glue.GlueArguments) and recipe.task in glue.TASKS
    assert privacy.target_epsilon == 3.0 and privacy.noise == "gaussian"
    assert training.max_grad_norm == 0.0


def test_hub_config_is_the_full_scale_setup():
    recipe, training, privacy = config.parse_recipe_args(
        (glue.GlueArguments, TrainingArguments, PrivacyArguments), ["--config", str(HUB_CONFIG)]
    )
    assert recipe.model_name_or_path == "roberta-base" and recipe.data_source == "hub"
    assert recipe.train_size is None and recipe.eval_size is None and recipe.lora_rank == 0
    assert not training.use_cpu


# --- docs configuration (slow) -------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_full_data("glue/sst2/train_full.tsv", "glue/sst2/dev.tsv")
def test_docs_config_learns_sst2(tmp_path):
    result = run_script("--config", str(DOCS_CONFIG), "--data_dir", str(FULL_DATA), "--output_dir", str(tmp_path),
                        "--results_file", str(tmp_path / "results.json"), timeout=1800)  # fmt: skip
    assert result["metrics"]["accuracy"] > 70.0  # majority class 50.9%
    assert result["privacy"]["epsilon"] <= 3.0 + 1e-6
