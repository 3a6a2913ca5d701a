"""bench/correlated_noise_recipes.py runs DP-SGD, banded and BLT noise on a recipe through its command line, and
renders docs/correlated_noise.md's recipe tables only from its recorded JSON."""

from __future__ import annotations

import argparse
import json

from bench_helpers import load_bench, page_and_rendering, render_into_scratch_page
from recipe_helpers import cifar_tiny_flags


def record(runs: list[dict]) -> dict:
    return {
        "command": "python bench/correlated_noise_recipes.py --task cifar --record cifar",
        "args": {"task": "cifar", "epsilons": [3.0, 8.0], "seeds": [0, 1], "threads": None},
        "environment": {"torch": "2.13.0+cpu", "threads": 2, "device_name": "AMD EPYC"},
        "task": "cifar",
        "metric": "accuracy",
        "threads": 2,
        "runs": runs,
    }


def run(noise: str, epsilon: float, seed: int, metric: float, sigma: float) -> dict:
    accountant = {"gaussian": "pld", "banded": "banded-mf", "blt": "blt-minsep"}[noise]
    return {"noise": noise, "target_epsilon": epsilon, "seed": seed, "metric": metric, "epsilon": epsilon - 0.002,
            "noise_multiplier": sigma, "accountant": accountant, "steps": 40, "train_seconds": 30.0}  # fmt: skip


RUNS = [run(noise, epsilon, seed, 20.0 + 2 * seed + epsilon, 1.0 + n) for seed in (0, 1) for epsilon in (3.0, 8.0)
        for n, noise in enumerate(("gaussian", "banded", "blt"))]  # fmt: skip


def test_rows_average_the_seeds_per_noise_and_epsilon(monkeypatch) -> None:
    text = load_bench(monkeypatch, "correlated_noise_recipes").markdown(record(RUNS))
    assert "| 3 | DP-SGD | 24.00 +- 1.41 | 2.998 | 1 | `pld` |" in text
    assert "| 8 | BLT, d = 4 | 29.00 +- 1.41 | 7.998 | 3 | `blt-minsep` |" in text
    assert "2 seeds [0, 1], 40 steps" in text and "2 threads per run" in text
    assert "python bench/correlated_noise_recipes.py --task cifar --record cifar" in text


def test_run_trains_every_noise_through_the_recipe_at_each_epsilon(monkeypatch, tmp_path) -> None:
    """One seed and epsilon on the CIFAR-10 recipe shrunk to a few steps: three processes, each with its noise, its
    accountant and the budget."""
    bench = load_bench(monkeypatch, "correlated_noise_recipes")
    command = bench.variant_command
    tiny = [flag for flag in cifar_tiny_flags(tmp_path) if not flag.startswith("--trainer.callbacks")]
    monkeypatch.setattr(bench, "variant_command", lambda *a: [*command(*a), *tiny, "--trainer.max_steps=4"])
    out = bench.run(argparse.Namespace(task="cifar", epsilons=[8.0], seeds=[1], threads=1))
    assert [(r["noise"], r["accountant"], r["seed"]) for r in out["runs"]] == [
        ("gaussian", "pld", 1), ("banded", "banded-mf", 1), ("blt", "blt-minsep", 1)]  # fmt: skip
    assert all(0 < r["epsilon"] <= 8.0 + 1e-6 and r["steps"] == 4 for r in out["runs"]) and out["threads"] == 1
    json.dumps(out)


def test_render_fills_the_markers(monkeypatch, tmp_path) -> None:
    bench = load_bench(monkeypatch, "correlated_noise_recipes")
    monkeypatch.setattr(bench, "FROM_RECIPE_RECORDS", {})  # the scratch page holds the CIFAR-10 markers only
    text = render_into_scratch_page(bench, monkeypatch, tmp_path, record(RUNS))
    assert f"{bench.START}\n{bench.markdown(record(RUNS))}\n{bench.END}" in text


def test_the_docs_page_is_the_rendering_of_the_committed_records(monkeypatch) -> None:
    page, rendered = page_and_rendering(
        load_bench(monkeypatch, "correlated_noise_recipes"),
        "python bench/correlated_noise_recipes.py --task cifar --record cifar",
    )
    assert page == rendered


def recipe_run(variant: str, seed: int, accuracy: float, cpu: str = "AMD EPYC") -> dict:
    noise, epsilon = variant.split("-eps")
    accountant = {"gaussian": "pld", "banded": "banded-mf", "blt": "blt-minsep"}[noise]
    flags = "" if seed == 0 else f" --seed {seed} --dp_seed {seed}"
    return {
        "metrics": {"accuracy": accuracy}, "steps": 132, "environment": {"torch": "2.13.0+cpu", "threads": 1,
        "device_name": cpu}, "privacy": {"epsilon": float(epsilon) - 0.001, "noise_multiplier": 0.75,
        "accountant": accountant}, "command": f"python recipes/glue.py --config c.yaml --target_epsilon {epsilon}"
        f" --output_dir /tmp/x{flags}",
    }  # fmt: skip


def test_the_sst2_table_shows_what_the_recipe_records_hold(monkeypatch) -> None:
    """SST-2's rows come from bench/recipes.py's records: each noise and epsilon recorded, over its seeds, in the
    order of the CIFAR-10 table, with the machines and the commands (the output folder left out)."""
    bench = load_bench(monkeypatch, "correlated_noise_recipes")
    results = {
        "blt-eps3": [recipe_run("blt-eps3", 0, 79.0, "Intel Xeon")],
        "gaussian-eps3": [recipe_run("gaussian-eps3", seed, 80.0 + seed) for seed in (0, 1, 2)],
        "banded-eps3": [recipe_run("banded-eps3", 0, 82.0)],
        "automatic-eps3": [recipe_run("gaussian-eps3", 0, 1.0)],  # another page's variant: not shown
    }
    text = bench.recipe_records_markdown("sst2_full", results)
    rows = [line for line in text.splitlines() if line.startswith("| 3 |")]
    assert rows == [
        "| 3 | DP-SGD | 81.00 +- 1.00 | 3 | 2.999 | 0.75 | `pld` | AMD EPYC (1) |",
        "| 3 | banded, b = 4 | 82.00 | 1 | 2.999 | 0.75 | `banded-mf` | AMD EPYC (1) |",
        "| 3 | BLT, d = 4 | 79.00 | 1 | 2.999 | 0.75 | `blt-minsep` | Intel Xeon (1) |",
    ]
    assert "132 steps" in text and text.count("python recipes/glue.py --config c.yaml") == 5 and "/tmp/x" not in text
    assert bench.recipe_records_markdown("sst2_full", {}) == "(no run recorded yet)"


def test_the_docs_sst2_table_is_the_rendering_of_the_recipe_records(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "correlated_noise_recipes")
    start, end = bench.FROM_RECIPE_RECORDS["sst2_full"]
    section = bench.PAGE.read_text(encoding="utf-8").split(start, 1)[1].split(end, 1)[0].strip("\n")
    assert section == bench.recipe_records_markdown("sst2_full", bench.load_results("sst2_full"))
