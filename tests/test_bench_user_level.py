"""bench/user_level.py renders docs/user_level.md only from its recorded JSON (no training is run here)."""

from __future__ import annotations

import json

import pytest
from bench_helpers import ROOT, load_bench


def _record() -> dict:
    audit = [
        {"unit": unit, "seed": seed, "reported_epsilon": 0.9994, "user_bound": bound, "guesses": 100, "correct": 90,
         "steps": 300, "noise_multiplier": 2.3, "sample_rate": 0.03, "training_rows": 3000}
        for unit, seed, bound in [("example", 0, 3.0), ("example", 1, 2.0), ("user", 0, 0.1), ("user", 1, 0.3)]
    ]  # fmt: skip
    utility = [
        {"unit": unit, "seed": seed, "test_acc": acc, "epsilon": 2.998, "delta": 1e-4, "noise_multiplier": 0.9,
         "steps": 120, "sample_rate": 0.04, "examples": 6000, "users": 1500, "largest_user": 100, "median_user": 1,
         "largest_user_epsilon": 299.8 if unit == "example" else 2.998}
        for unit, seed, acc in [("example", 0, 0.60), ("example", 1, 0.62), ("user", 0, 0.58), ("user", 1, 0.60)]
    ]  # fmt: skip
    args = {"seeds": [0, 1], "canary_examples": 20, "audit_epsilon": 1.0, "epsilon": 3.0}
    return {"command": "python bench/user_level.py --seeds 0 1", "args": args, "environment": {"threads": 1},
            "audit": audit, "utility": utility}  # fmt: skip


def test_tables_average_the_seeds_and_count_the_exceeded_claims(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "user_level")
    text = bench.markdown(_record())
    assert "| example | 0.999 +- 0.000 | 2.50 +- 0.71 | 2 of 2 | 300 | 2.3 |" in text
    assert "| user | 0.999 +- 0.000 | 0.20 +- 0.14 | 0 of 2 | 300 | 2.3 |" in text
    assert "| example | 61.0 +- 1.4 | 2.998 | 0.0001 | 300 | 120 | 0.9 |" in text
    assert "| user | 59.0 +- 1.4 | 2.998 | 0.0001 | 3 | 120 | 0.9 |" in text
    assert "python bench/user_level.py --seeds 0 1" in text


def test_the_docs_page_is_the_rendering_of_the_committed_records(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "user_level")
    records = sorted(bench.RECORDS.glob("*.json"))
    if not records:
        pytest.fail("docs/bench/user_level/ holds no record: run python bench/user_level.py --seeds 0 1 2 --record cpu")
    page = (ROOT / "docs" / "user_level.md").read_text()
    rendered = "\n\n".join(bench.markdown(json.loads(path.read_text())) for path in records)
    assert page.split(bench.START, 1)[1].split(bench.END, 1)[0].strip("\n") == rendered
