"""bench/op_count.py: it counts a tiny configuration on both adapters (no host read of the library's own in a
steady-state step, more ops in a DP step than in the non-private one), renders a record with and without ``before``,
and its docs section is the rendering of the recorded JSON (no count is asserted against the record)."""

from __future__ import annotations

import argparse
import json

import pytest
from bench_helpers import load_bench, page_and_rendering, render_into_scratch_page

TINY = argparse.Namespace(dim=8, blocks=1, batch_size=4, warmup=2, steps=1)


@pytest.mark.parametrize("adapter", ["lightning", "hf"])
def test_counts_a_tiny_step_on_each_adapter(monkeypatch, adapter) -> None:
    bench = load_bench(monkeypatch, "op_count")
    private, plain = bench.count(TINY, adapter, True), bench.count(TINY, adapter, False)
    assert private["library_syncs"] == 0 and private["syncs"] <= plain["syncs"]
    assert private["ops"] > plain["ops"] > 0 and sum(private["top_ops"].values()) <= private["ops"]


def _record(with_before: bool) -> dict:
    row = {"ops": 10.0, "top_ops": {"mm": 2.0}, "syncs": 0.0, "library_syncs": 0.0}
    counts = {adapter: {"dp": row, "non_private": {**row, "ops": 5.0}} for adapter in ("lightning", "hf")}
    record = {
        "command": "python bench/op_count.py",
        "args": {"dim": 8, "blocks": 1, "batch_size": 4, "warmup": 2, "steps": 1},
        "environment": {"torch": "2.13.0+cpu"},
        "after": {"commit": "abc1234", "counts": counts},
    }
    if with_before:
        record["before"] = {"commit": "0000000", "counts": json.loads(json.dumps(counts))}
    return record


@pytest.mark.parametrize("with_before", [True, False])
def test_renders_a_record(monkeypatch, tmp_path, with_before) -> None:
    bench = load_bench(monkeypatch, "op_count")
    page = render_into_scratch_page(bench, monkeypatch, tmp_path, _record(with_before))
    assert "| lightning | 5 | 10 |" in page and "2.00x" in page
    assert ("DP ops before (0000000)" in page) == with_before and "python bench/op_count.py" in page


def test_the_page_is_the_rendering_of_the_records(monkeypatch) -> None:
    page, rendered = page_and_rendering(load_bench(monkeypatch, "op_count"), "python bench/op_count.py --record NAME")
    assert page == rendered
