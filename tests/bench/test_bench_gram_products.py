"""bench/gram_products.py times the three paths of a long use's Gram matrix at toy sizes (no timing is asserted) and
renders its docs section only from its recorded JSON."""

from __future__ import annotations

import argparse

from bench_helpers import load_bench, page_and_rendering


def test_a_toy_run_times_every_path_of_every_shape(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "gram_products")
    out = bench.measure(argparse.Namespace(shapes=["2x6x5", "1x130x7"], rounds=2, threads=1))
    assert [shape["shape"] for shape in out["shapes"]] == ["2x6x5", "1x130x7"]
    assert all(sorted(shape["ms"]) == ["panels", "triangle", "whole"] for shape in out["shapes"])
    assert all(len(values) == 2 for shape in out["shapes"] for values in shape["ms"].values())


def test_markdown_gives_each_shapes_times_ratios_and_the_path_the_cpu_takes(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "gram_products")
    record = {
        "command": "python bench/gram_products.py",
        "threads": 1,
        "rounds": 2,
        "environment": {"device_name": "Some CPU", "torch": "2.13.0+cpu", "load_before": 0.1, "load_after": 1.0},
        "shapes": [
            {"shape": "8x512x64", "ms": {"triangle": [3.0, 5.0], "panels": [6.0, 6.0], "whole": [8.0, 8.0]}},
            {"shape": "8x64x64", "ms": {"triangle": [1.0, 1.0], "panels": [1.0, 1.0], "whole": [1.0, 1.0]}},
        ],
    }
    text = bench.markdown(record)
    assert "python bench/gram_products.py" in text and "Some CPU" in text
    assert "| 8x512x64 | 4 | 6 | 8 | 0.50 | 0.75 | triangle |" in text
    assert "| 8x64x64 | 1 | 1 | 1 | 1.00 | 1.00 | whole |" in text


def test_the_docs_section_is_the_rendering_of_the_committed_records(monkeypatch) -> None:
    page, rendered = page_and_rendering(
        load_bench(monkeypatch, "gram_products"), "python bench/gram_products.py --record NAME"
    )
    assert page == rendered
