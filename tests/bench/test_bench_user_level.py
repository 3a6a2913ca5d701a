"""bench/user_level.py renders docs/user_level.md only from its recorded JSON (no training is run here)."""

from __future__ import annotations

from bench_helpers import load_bench, page_and_rendering


def _record(threads: int = 1) -> dict:
    audit = [
        {"unit": unit, "seed": seed, "reported_epsilon": 0.9994, "user_bound": bound, "guesses": 100, "correct": 90,
         "steps": steps, "noise_multiplier": sigma, "sample_rate": 0.03, "training_rows": 3000}
        for unit, seed, bound, steps, sigma in [("example", 0, 3.0, 300, 2.3), ("example", 1, 2.0, 320, 2.4),
                                                ("user", 0, 0.1, 120, 3.9), ("user", 1, 0.3, 120, 3.9)]
    ]  # fmt: skip
    # each seed draws its own training set: its size, and the example-level run's delta, steps and sigma differ
    sizes = {0: 6000, 1: 5500}
    utility = [
        {"unit": unit, "seed": seed, "test_acc": acc, "epsilon": 2.998, "delta": delta, "noise_multiplier": sigma,
         "steps": steps, "sample_rate": 0.04, "examples": sizes[seed], "users": 1500, "largest_user": 100,
         "median_user": 1, "largest_user_epsilon": 299.8 if unit == "example" else 2.998}
        for unit, seed, acc, delta, steps, sigma in [
            ("example", 0, 0.60, 7e-5, 125, 0.95), ("example", 1, 0.62, 8e-5, 110, 0.97),
            ("user", 0, 0.58, 3.2e-4, 120, 0.891), ("user", 1, 0.60, 3.2e-4, 120, 0.891),
        ]
    ]  # fmt: skip
    args = {"seeds": [0, 1], "canary_examples": 20, "audit_epsilon": 1.0, "epsilon": 3.0}
    return {"command": "python bench/user_level.py --seeds 0 1", "args": args, "environment": {"threads": threads},
            "audit": audit, "utility": utility}  # fmt: skip


def test_tables_average_the_seeds_count_the_exceeded_claims_and_give_ranges(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "user_level")
    text = bench.markdown(_record())
    assert "| example | 0.999 +- 0.000 | 2.50 +- 0.71 | 2 of 2 | 300 to 320 | 2.3 to 2.4 |" in text
    assert "| user | 0.999 +- 0.000 | 0.20 +- 0.14 | 0 of 2 | 120 | 3.9 |" in text
    assert "Utility: 1500 training users with 5500 to 6000 examples (median 1 per user, largest 100)," in text
    assert "| example | 61.0 +- 1.4 | 2.998 | 7e-05 to 8e-05 | 300 | 110 to 125 | 0.95 to 0.97 |" in text
    assert "| user | 59.0 +- 1.4 | 2.998 | 0.00032 | 3 | 120 | 0.891 |" in text
    assert "(seed 0)" not in text  # no column shows one seed's value as the run's
    assert "python bench/user_level.py --seeds 0 1" in text
    assert text.startswith("Command (2 seeds; 1 thread):")
    assert bench.markdown(_record(threads=2)).startswith("Command (2 seeds; 2 threads):")


def test_the_docs_page_is_the_rendering_of_the_committed_records(monkeypatch) -> None:
    page, rendered = page_and_rendering(
        load_bench(monkeypatch, "user_level"), "python bench/user_level.py --seeds 0 1 2 --record cpu"
    )
    assert page == rendered
