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
    text = render_into_scratch_page(bench, monkeypatch, tmp_path, record(RUNS))
    assert f"{bench.START}\n{bench.markdown(record(RUNS))}\n{bench.END}" in text


def test_the_docs_page_is_the_rendering_of_the_committed_records(monkeypatch) -> None:
    page, rendered = page_and_rendering(
        load_bench(monkeypatch, "correlated_noise_recipes"),
        "python bench/correlated_noise_recipes.py --task cifar --record cifar",
    )
    assert page == rendered
