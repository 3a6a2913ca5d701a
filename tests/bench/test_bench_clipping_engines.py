"""bench/clipping_engines.py renders its docs section only from the recorded JSON (no timing is run here)."""

from __future__ import annotations

from bench_helpers import load_bench, page_and_rendering, render_into_scratch_page

MIB = 2**20


def record() -> dict:
    return {
        "command": "python bench/clipping_engines.py --model gpt2 --device cuda --variants non-private mixed-bk",
        "args": {
            "model": "gpt2",
            "seq_len": 128,
            "batch_size": 8,
            "device": "cuda",
            "threads": 1,
            "steps": 5,
            "warmup": 1,
        },  # fmt: skip
        "environment": {"torch": "2.11.0+cu130", "device_name": "Some GPU", "load_before": 0.5, "load_after": 1.0},
        "order": ["non-private", "mixed-bk", "opacus-ghost"],
        "results": {
            "non-private": {
                "seconds": 0.02,
                "cpu_seconds": 0.019,
                "peak_bytes": 100 * MIB,
                "time_ratio": 1.0,
                "memory_ratio": 1.0,
            },  # fmt: skip
            "mixed-bk": {
                "seconds": 0.025,
                "cpu_seconds": 0.024,
                "peak_bytes": 110 * MIB,
                "time_ratio": 1.25,
                "memory_ratio": 1.1,
            },  # fmt: skip
            "opacus-ghost": {"error": "NotImplementedError: Parameter tying is not supported with Ghost Clipping"},
        },
    }


def test_markdown_holds_the_command_and_the_recorded_numbers(monkeypatch):
    bench = load_bench(monkeypatch, "clipping_engines")
    text = bench.markdown(record())
    assert text.startswith("**gpt2, T=128, B=8** (Some GPU, torch 2.11.0+cu130; median of 5 interleaved steps")
    assert "time ratios of wall time" in text and "intra-op" not in text  # threads only matter on CPU
    assert "python bench/clipping_engines.py --model gpt2 --device cuda --variants non-private mixed-bk" in text
    assert "| mixed-bk | 25 | 24 | 1.25 | 110.0 | 1.10 |" in text
    assert "| opacus-ghost | NotImplementedError: Parameter tying is not supported with Ghost Clipping |" in text
    assert bench.report_lines(record())[2].split() == ["non-private", "0.020", "0.019", "1.00", "100.0", "1.00"]


def test_render_replaces_only_the_marked_section(monkeypatch, tmp_path):
    bench = load_bench(monkeypatch, "clipping_engines")
    text = render_into_scratch_page(bench, monkeypatch, tmp_path, record())
    assert text.startswith(f"intro\n{bench.START}\n**gpt2, T=128, B=8**") and text.endswith(f"{bench.END}\nend\n")


def test_the_docs_page_is_the_rendering_of_the_committed_records(monkeypatch) -> None:
    page, rendered = page_and_rendering(
        load_bench(monkeypatch, "clipping_engines"),
        "python bench/clipping_engines.py --device cuda --record NAME",
    )
    assert page == rendered
