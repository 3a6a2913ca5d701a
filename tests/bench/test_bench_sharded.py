"""bench/sharded.py renders its docs section only from the recorded JSON (no timing is run here)."""

from __future__ import annotations

from bench_helpers import load_bench, page_and_rendering, render_into_scratch_page

MIB = 2**20


def record() -> dict:
    plain = {
        "steps": 5, "cpu_seconds": 0.8, "wall_seconds": 1.6, "state_bytes": 100 * MIB, "peak_extra_bytes": 400 * MIB,
        "peak_bytes": 1000 * MIB, "time_ratio": 1.0, "state_ratio": 1.0, "peak_extra_ratio": 1.0, "peak_ratio": 1.0,
    }  # fmt: skip
    ours = {
        "steps": 5, "cpu_seconds": 0.88, "wall_seconds": 1.7, "state_bytes": 100 * MIB, "peak_extra_bytes": 420 * MIB,
        "peak_bytes": 1020 * MIB, "time_ratio": 1.1, "state_ratio": 1.0, "peak_extra_ratio": 1.05, "peak_ratio": 1.02,
    }  # fmt: skip
    return {
        "command": "python bench/sharded.py --variants ours-mixed opacus-fsdp-ghost",
        "args": {
            "seq_len": 128,
            "batch_size": 4,
            "world_size": 2,
            "rounds": 3,
            "steps_per_round": 2,
            "skip_first": 1,
            "device": "cpu",
            "threads": 1,
        },  # fmt: skip
        "environment": {"torch": "2.13.0+cpu", "device_name": "Some CPU", "load_before": 0.5, "load_after": 1.0},
        "order": ["fsdp-plain", "ours-mixed", "opacus-fsdp-ghost"],
        "results": {
            "fsdp-plain": plain,
            "ours-mixed": ours,
            "opacus-fsdp-ghost": {"error": "NotImplementedError: something Opacus refuses"},
        },
    }


def test_markdown_holds_the_command_and_the_recorded_numbers(monkeypatch):
    text = load_bench(monkeypatch, "sharded").markdown(record())
    assert "**T=128, B=4 per rank x 2 ranks** (Some CPU, torch 2.13.0+cpu, 1 intra-op thread," in text
    assert "python bench/sharded.py --variants ours-mixed opacus-fsdp-ghost" in text
    assert "| variant | steps | cpu s / step | x fsdp-plain | state MiB / rank |" in text
    assert "| fsdp-plain | 5 | 0.8 | 1.00 | 100.0 | 1.00 | 400.0 | 1.00 | 1000.0 | 1.00 |" in text
    assert "| ours-mixed | 5 | 0.88 | 1.10 | 100.0 | 1.00 | 420.0 | 1.05 | 1020.0 | 1.02 |" in text
    assert "| opacus-fsdp-ghost | NotImplementedError: something Opacus refuses | | | | | | | | |" in text


def test_the_plain_text_report_has_one_line_per_variant(monkeypatch):
    lines = load_bench(monkeypatch, "sharded").report_lines(record())
    expected = "fsdp-plain 5 0.800 1.600 1.00 100.0 1.00 400.0 1.00 1000.0 1.00"
    assert lines[2].split() == expected.split()
    assert lines[4] == f"{'opacus-fsdp-ghost':<18} NotImplementedError: something Opacus refuses"


def test_render_replaces_only_the_marked_section(monkeypatch, tmp_path):
    bench = load_bench(monkeypatch, "sharded")
    text = render_into_scratch_page(bench, monkeypatch, tmp_path, record())
    assert text.startswith(f"intro\n{bench.START}\n**T=128, B=4 per rank x 2 ranks**")
    assert text.endswith(f"{bench.END}\nend\n")
    assert "old" not in text


def test_the_docs_page_is_the_rendering_of_the_committed_records(monkeypatch) -> None:
    page, rendered = page_and_rendering(load_bench(monkeypatch, "sharded"), "python bench/sharded.py --record cpu_t128")
    assert page == rendered
