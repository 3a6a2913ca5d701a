"""bench/adaptive_clipping.py renders docs/adaptive_clipping.md (and its figure) only from its recorded JSON (no
training is run here)."""

from __future__ import annotations

import argparse
import json

import torch
from bench_helpers import load_bench, page_and_rendering


def record(runs: list[dict]) -> dict:
    return {
        "command": "python bench/adaptive_clipping.py --seeds 0 1",
        "args": {"epochs": 15, "target_epsilon": 3.0, "seeds": [0, 1]},
        "environment": {"torch": "2.13.0+cpu", "threads": 2},
        "runs": runs,
    }


def run(variant: str, seed: int, acc: float, bounds: list[float]) -> dict:
    return {"variant": variant, "seed": seed, "test_acc": acc, "epsilon": 2.998, "noise_multiplier": 1.971,
            "bounds": bounds}  # fmt: skip


RUNS = [run("fixed C=1", 0, 0.90, [1.0, 1.0]), run("adaptive from C=10", 0, 0.20, [12.0, 50.0]),
        run("automatic C=1, lr=2", 0, 0.93, [1.0, 1.0]),
        run("fixed C=1", 1, 0.92, [1.0, 1.0]), run("adaptive from C=10", 1, 0.10, [11.0, 60.0]),
        run("automatic C=1, lr=2", 1, 0.95, [1.0, 1.0])]  # fmt: skip


def test_rows_average_the_seeds_and_the_bound_at_the_end(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "adaptive_clipping")
    text = bench.markdown(record(RUNS))
    assert "| fixed C=1 | 91.0 +- 1.4 | 1 | 2.998 | 1.971 |" in text
    assert "| adaptive from C=10 | 15.0 +- 7.1 | 55 | 2.998 | 1.971 |" in text  # final bounds 50 and 60
    assert "| automatic C=1, lr=2 | 94.0 +- 1.4 | 1 | 2.998 | 1.971 |" in text  # the bound is the fixed C
    assert text.index("| fixed C=1 |") < text.index("| adaptive from C=10 |")  # the variants in order of first run
    assert "python bench/adaptive_clipping.py --seeds 0 1" in text


def test_the_automatic_variants_keep_the_sensitivity_and_change_only_the_learning_rate(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "adaptive_clipping")
    automatic = {name: options for name, options in bench.VARIANTS.items() if name.startswith("automatic")}
    assert list(automatic) == [f"automatic C=1, lr={lr:g}" for lr in bench.AUTOMATIC_LEARNING_RATES]
    for options in automatic.values():  # the demo's C = 1 and the option's gamma: the same noise and epsilon
        assert set(options) == {"clipping_fn", "lr"} and options["clipping_fn"] == "automatic"


def test_run_trains_every_variant_per_seed_with_its_options_on_the_threads_asked(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "adaptive_clipping")
    calls = []

    def fake_run_demo(*, callbacks, **options) -> dict:
        calls.append({**options, "threads": torch.get_num_threads()})
        callbacks[0].bounds.append(options.get("max_grad_norm", 1.0))
        return {"test_acc": 0.9, "epsilon": 2.998, "privacy": {"noise_multiplier": 1.971}}

    monkeypatch.setattr("lightning_dp.cli.demo.run_demo", fake_run_demo)
    threads = torch.get_num_threads()
    try:
        out = bench.run(argparse.Namespace(epochs=2, target_epsilon=3.0, seeds=[0, 1], threads=1))
    finally:
        torch.set_num_threads(threads)
    assert [(r["seed"], r["variant"]) for r in out["runs"]] == [(s, v) for s in (0, 1) for v in bench.VARIANTS]
    for call, (seed, options) in zip(calls, [(s, o) for s in (0, 1) for o in bench.VARIANTS.values()], strict=True):
        assert call["threads"] == 1 and call["seed"] == seed and call["epochs"] == 2
        assert {key: call[key] for key in options} == options
    assert out["runs"][0]["bounds"] == [0.1]


def recipe_run(seed: int, accuracy: float, sigma: float, bounds: list[float] | None = None) -> dict:
    history = [{"step": 22 * (i + 1), "dp/max_grad_norm": bound} for i, bound in enumerate(bounds or [])]
    return {
        "metrics": {"accuracy": accuracy},
        "privacy": {"epsilon": 2.999, "noise_multiplier": sigma, "max_grad_norm": 1.0, "accountant": "pld"},
        "train_size": 67349,
        "environment": {"torch": "2.13.0+cpu", "threads": 1, "device_name": "AMD EPYC"},
        "history": history,
        "command": f"python recipes/glue.py --config c.yaml --seed {seed} --output_dir /tmp/x",
    }


SST2 = {
    "non-private": [recipe_run(0, 85.0, 0.0)],
    "gaussian-eps3": [recipe_run(0, 81.0, 0.7463), recipe_run(1, 82.0, 0.7463)],
    "adaptive-eps3": [recipe_run(0, 80.0, 0.7464, [1.6, 2.0]), recipe_run(1, 79.0, 0.7464, [1.5, 3.0])],
}


def test_the_sst2_table_compares_the_recipes_fixed_bound_with_adaptive_and_automatic_clipping(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "adaptive_clipping")
    text = bench.sst2_markdown(SST2)
    assert "| fixed C=1 | 81.50 +- 0.71 | 2 | 1 | 2.999 | 0.7463 | AMD EPYC (1) |" in text
    assert "| adaptive from C=1 | 79.50 +- 0.71 | 2 | 2.5 | 2.999 | 0.7464 | AMD EPYC (1) |" in text  # last 2 and 3
    assert "non-private" not in text and "automatic" not in text  # only the compared variants recorded
    assert "all 67,349 training sentences" in text and "python recipes/glue.py --config c.yaml --seed 1" in text
    assert bench.sst2_markdown({"non-private": SST2["non-private"]}) == "(no run recorded yet)"


def test_render_fills_the_markers_and_draws_the_figure(monkeypatch, tmp_path) -> None:
    bench = load_bench(monkeypatch, "adaptive_clipping")
    monkeypatch.setattr(bench, "load_results", lambda task: SST2 if task == "sst2_full" else {})
    records = tmp_path / "records"
    records.mkdir()
    (records / "digits.json").write_text(json.dumps(record(RUNS)))
    page = tmp_path / "page.md"
    page.write_text(f"intro\n{bench.START}\nold\n{bench.END}\nmid\n{bench.SST2_START}\nold\n{bench.SST2_END}\nend\n")
    for attribute, value in (("RECORDS", records), ("PAGE", page), ("FIGURE", tmp_path / "figure.png")):
        monkeypatch.setattr(bench, attribute, value)
    bench.render()
    assert page.read_text() == (
        f"intro\n{bench.START}\n{bench.markdown(record(RUNS))}\n{bench.END}\nmid\n"
        f"{bench.SST2_START}\n{bench.sst2_markdown(SST2)}\n{bench.SST2_END}\nend\n"
    )
    assert (tmp_path / "figure.png").read_bytes().startswith(b"\x89PNG")


def test_the_docs_page_is_the_rendering_of_the_committed_records(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "adaptive_clipping")
    page, rendered = page_and_rendering(bench, "python bench/adaptive_clipping.py --record digits")
    assert page == rendered
    sst2 = bench.PAGE.read_text(encoding="utf-8").split(bench.SST2_START, 1)[1].split(bench.SST2_END, 1)[0]
    assert sst2.strip("\n") == bench.sst2_markdown(bench.load_results("sst2_full"))
