"""bench/correlated_noise_adam.py: its computed noise is that of the SST-2 recipe's recorded runs, its runs are the
recipe's variants at another learning rate, its table puts each number under its heading, and
docs/correlated_noise.md shows its rendering."""

from __future__ import annotations

import copy
import json

import pytest
from bench_helpers import ROOT, load_bench

RECORDS = ROOT / "docs" / "recipes" / "sst2_full"


def _record(variant: str) -> dict:
    return json.loads((RECORDS / f"{variant}.json").read_text())


def test_the_computed_noise_is_that_of_the_recorded_runs(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "correlated_noise_adam")
    dp_sgd, banded = _record("gaussian-eps3"), _record("banded-eps3")
    numbers = bench.recorded_noise()
    assert numbers == bench.noise_per_step(dp_sgd, banded)
    assert numbers["column_norm"] == pytest.approx(banded["privacy"]["max_column_norm"], rel=1e-6)  # the run's C
    assert numbers["sigma_dp_sgd"] == dp_sgd["privacy"]["noise_multiplier"]
    assert numbers["sigma_banded"] == banded["privacy"]["noise_multiplier"] * numbers["column_norm"]
    # the noise's norm in the averaged gradient: sigma C sqrt(d) / B (74,498 parameters, B = 1024, C = 1)
    assert numbers["noise_norm_dp_sgd"] == pytest.approx(dp_sgd["privacy"]["noise_multiplier"] * 74498**0.5 / 1024)
    assert numbers["noise_norm_banded"] / numbers["noise_norm_dp_sgd"] == pytest.approx(numbers["step_std_ratio"])
    assert numbers["step_std_ratio"] > 1 > numbers["error_ratio"]  # more noise per step, less in the iterates
    dp_sgd_as_band_1 = copy.deepcopy(dp_sgd)
    dp_sgd_as_band_1["privacy"].update(correlation_band=1, max_column_norm=1.0)
    same = bench.noise_per_step(dp_sgd, dp_sgd_as_band_1)  # band 1 is DP-SGD: the same noise per step and error
    assert same["step_std_ratio"] == same["error_ratio"] == same["error_ratio_momentum"] == pytest.approx(1.0)
    other = copy.deepcopy(banded)
    other["privacy"]["max_column_norm"] = 2.0
    with pytest.raises(ValueError, match="column norm"):
        bench.noise_per_step(dp_sgd, other)
    other = copy.deepcopy(banded)
    other["arguments"]["training"]["warmup_steps"] = 10
    with pytest.raises(ValueError, match="without warm-up"):
        bench.noise_per_step(dp_sgd, other)


def test_a_run_is_the_recipes_variant_at_the_learning_rate(monkeypatch, tmp_path) -> None:
    bench = load_bench(monkeypatch, "correlated_noise_adam")
    calls = []
    monkeypatch.setattr(bench, "run_variant", lambda *args: calls.append(args))
    monkeypatch.setattr(bench, "RECORDS", tmp_path / "learning_rate")
    bench.run(0.006, [0, 1], threads=1)
    flags = ["--learning_rate", "0.006"]
    assert calls == [
        ("sst2_full", "gaussian-eps3", 0, tmp_path / "learning_rate" / "gaussian-eps3.lr0.006.json", 1, flags),
        ("sst2_full", "banded-eps3", 0, tmp_path / "learning_rate" / "banded-eps3.lr0.006.json", 1, flags),
        ("sst2_full", "gaussian-eps3", 1, tmp_path / "learning_rate" / "gaussian-eps3.lr0.006.seed1.json", 1, flags),
        ("sst2_full", "banded-eps3", 1, tmp_path / "learning_rate" / "banded-eps3.lr0.006.seed1.json", 1, flags),
    ]
    with pytest.raises(ValueError, match="the recipe's own rate"):
        bench.run(0.002, [0], threads=1)


def test_the_runs_table_puts_each_number_under_its_heading(monkeypatch, tmp_path) -> None:
    bench = load_bench(monkeypatch, "correlated_noise_adam")
    monkeypatch.setattr(bench, "RECORDS", tmp_path)
    assert bench.runs_markdown(bench.load_runs()) == "(no run recorded yet)"
    for variant, accuracy in (("gaussian-eps3", 81.0), ("banded-eps3", 82.0)):
        result = _record(variant)
        result["arguments"]["training"]["learning_rate"] = 0.006
        result["metrics"]["accuracy"] = accuracy
        (tmp_path / f"{variant}.lr0.006.json").write_text(json.dumps(result))
    text = bench.runs_markdown(bench.load_runs())
    table = [line for line in text.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 4 and len({line.count("|") for line in table}) == 1  # 2 rates x 2 noises
    assert "| 0.006 | banded, b = 4 | 82.00 (seed 0) | 82.00 | 0.595 | 2.999 |" in text
    assert "132 steps, target epsilon 3; the new head's learning rate 0.01 in every run" in text
    result["arguments"]["training"]["learning_rate"] = 0.002
    (tmp_path / "banded-eps3.lr0.002.json").write_text(json.dumps(result))
    with pytest.raises(ValueError, match="the recipe's own rate"):
        bench.load_runs()


def test_the_page_shows_the_rendering(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "correlated_noise_adam")
    page = bench.PAGE.read_text(encoding="utf-8")
    for (start, end), text in (
        (bench.NOISE_MARKERS, bench.noise_markdown(bench.recorded_noise())),
        (bench.RUN_MARKERS, bench.runs_markdown(bench.load_runs())),
    ):
        assert page.split(start, 1)[1].split(end, 1)[0].strip() == text.strip()
