"""bench/per_sample_norms.py renders its section of docs/recipes/sst2_full.md only from its recorded JSON (the
measurement itself needs the full SST-2 copy and the packaged encoder; not run here)."""

from __future__ import annotations

import pytest
from bench_helpers import load_bench, page_and_rendering


def test_markdown_gives_the_quantiles_the_head_share_and_the_confidence_thresholds(monkeypatch) -> None:
    """Two examples: norms 3 and 5 (the head 2.4 and 4.8, shares 64% and 92.16%), labels at probability 0.5 and
    0.25: with the head's gradient sqrt(2)(1 - p_y)|[h; 1]| an example leaves C's reach at p_y = 1 - C (1 - p_y) /
    |head|."""
    bench = load_bench(monkeypatch, "per_sample_norms")
    record = {
        "command": "python bench/per_sample_norms.py",
        "args": {"config": "configs/x.yaml", "seed": 0, "head": "classifier"},
        "totals": [3.0, 5.0],
        "heads": [2.4, 4.8],
        "p_label": [0.5, 0.25],
    }
    text = bench.markdown(record)
    assert "2 training examples of `configs/x.yaml`" in text and "python bench/per_sample_norms.py" in text
    assert "median 78.1%, smallest 64.0%" in text
    median_threshold = (1 - 0.1 * 0.5 / 2.4 + 1 - 0.1 * 0.75 / 4.8) / 2
    assert f"| 0.1 | 100% | {median_threshold:.4f} |" in text
    assert f"| 1 | 100% | {(1 - 0.5 / 2.4 + 1 - 0.75 / 4.8) / 2:.4f} |" in text
    assert bench._quantile([1.0, 2.0, 3.0], 50) == pytest.approx(2.0)


def test_the_docs_page_is_the_rendering_of_the_committed_records(monkeypatch) -> None:
    page, rendered = page_and_rendering(
        load_bench(monkeypatch, "per_sample_norms"), "python bench/per_sample_norms.py --record sst2_full"
    )
    assert page == rendered
