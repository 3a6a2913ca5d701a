"""bench/tuning_digits.py renders docs/tuning.md's measured example only from its recorded JSON (no training is run
here)."""

from __future__ import annotations

from bench_helpers import load_bench, page_and_rendering, render_into_scratch_page


def seed_row(seed: int, search: float, one: float, naive: float, candidates: int) -> dict:
    return {
        "seed": seed,
        "search": {"test_acc": search, "epsilon": 2.998, "noise_multiplier": 3.121, "candidates": candidates},
        "one_run": {"test_acc": one, "noise_multiplier": 2.114},
        "naive": {"test_acc": naive, "true_epsilon": 5.2, "noise_multiplier": 2.114},
    }


def record(rows: list[dict]) -> dict:
    return {
        "command": "python bench/tuning_digits.py --seeds 0 1",
        "args": {"epochs": 15, "target_epsilon": 3.0, "mean": 3.0, "seeds": [0, 1]},
        "environment": {"torch": "2.13.0+cpu", "threads": 1},
        "seeds": rows,
    }


ROWS = [seed_row(0, 0.90, 0.88, 0.93, 2), seed_row(1, 0.92, 0.86, 0.95, 5)]


def test_one_row_per_arm_averaged_over_the_seeds(monkeypatch) -> None:
    text = load_bench(monkeypatch, "tuning_digits").markdown(record(ROWS))
    assert "| search (geometric, mean 3) | 91.0 +- 1.4 | 2.998 | 3.121 | 2, 5 |" in text
    assert "| one run (lr 1, C 1) | 87.0 +- 1.4 | 3 | 2.114 | 1 |" in text
    assert "| naive best-of-3, each at epsilon 3 | 94.0 +- 1.4 | 3 claimed, 5.200 composed | 2.114 | 3 |" in text
    assert "python bench/tuning_digits.py --seeds 0 1" in text and "1 thread)" in text


def test_render_fills_the_markers(monkeypatch, tmp_path) -> None:
    bench = load_bench(monkeypatch, "tuning_digits")
    text = render_into_scratch_page(bench, monkeypatch, tmp_path, record(ROWS))
    assert text == f"intro\n{bench.START}\n{bench.markdown(record(ROWS))}\n{bench.END}\nend\n"


def test_the_docs_page_is_the_rendering_of_the_committed_records(monkeypatch) -> None:
    page, rendered = page_and_rendering(
        load_bench(monkeypatch, "tuning_digits"), "python bench/tuning_digits.py --record digits"
    )
    assert page == rendered
