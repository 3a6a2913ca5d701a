"""bench/group_clipping.py renders docs/group_clipping.md only from its recorded JSON (no training is run here)."""

from __future__ import annotations

from bench_helpers import load_bench, page_and_rendering


def record(runs: list[dict]) -> dict:
    return {
        "command": "python bench/group_clipping.py",
        "args": {"epochs": 15, "target_epsilon": 3.0, "seeds": [0, 1]},
        "environment": {"torch": "2.13.0+cpu", "threads": 2},
        "runs": runs,
    }


def run(variant: str, seed: int, acc: float, bounds: dict | None) -> dict:
    return {"variant": variant, "seed": seed, "test_acc": acc, "epsilon": 2.998, "noise_multiplier": 1.971,
            "group_bounds": bounds}  # fmt: skip


def test_rows_average_the_seeds_and_name_the_group_bounds(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "group_clipping")
    equal = {"net.0": 0.5, "net.3": 0.5}
    text = bench.markdown(
        record([run("flat, C=1", 0, 0.90, None), run("flat, C=1", 1, 0.92, None),
                run("per_layer, C=1", 0, 0.80, equal), run("per_layer, C=1", 1, 0.84, equal)])
    )  # fmt: skip
    assert "| flat, C=1 | 91.0 +- 1.4 | - | 2.998 | 1.971 |" in text
    assert "| per_layer, C=1 | 82.0 +- 2.8 | 2 x 0.5 | 2.998 | 1.971 |" in text
    assert "python bench/group_clipping.py" in text
    assert bench.bounds_text({"a": 0.3, "b": 0.4}) == "a: 0.3, b: 0.4"


def test_the_docs_page_is_the_rendering_of_the_committed_records(monkeypatch) -> None:
    page, rendered = page_and_rendering(
        load_bench(monkeypatch, "group_clipping"), "python bench/group_clipping.py --record digits"
    )
    assert page == rendered
