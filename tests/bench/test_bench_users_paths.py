"""bench/users_paths.py renders its docs section (bench/users_paths_report.py) only from the recorded JSON; its
breakdown and profile drive the engine as the strategy does (no timing is asserted)."""

from __future__ import annotations

from bench_helpers import load_bench, page_and_rendering, render_into_scratch_page


def record() -> dict:
    parts = {part: 0.1 for part in ("user forward", "check forwards", "per_sample_loss rest", "opt step")}
    parts |= {"clip (backward)": 1.0, "privatise (noise)": 0.2}
    parts |= {"rest (framework, adapter)": 0.05, "step": 1.65, "examples": 8.0}
    return {
        "command": "python bench/users_paths.py --model gpt2 --seq-len 128 --batch-size 8 --clipping mixed",
        "args": {
            "model": "gpt2",
            "seq_len": 128,
            "batch_size": 8,
            "device": "cpu",
            "threads": 1,
            "rounds": 5,
            "steps_per_round": 4,
            "skip_first": 1,
        },  # fmt: skip
        "environment": {"torch": "2.13.0+cpu", "device_name": "Some CPU", "load_before": 0.5, "load_after": 1.0},
        "order": ["hf-plain", "hf-dp-mixed"],
        "results": {
            "hf-plain": {"steps": 15, "cpu_per_example": 0.2, "wall_per_example": 0.21, "ratio": 1.0},
            "hf-dp-mixed": {
                "steps": 15,
                "cpu_per_example": 0.22,
                "wall_per_example": 0.23,
                "ratio": 1.1,
                "round_ratios": [1.12, 1.08, 1.1, 1.131, 1.09],
            },
        },
        "breakdown": {"hf-dp-mixed": parts},
        "profile": {
            "hf-dp-mixed": {
                "dp_ms": 1800.0,
                "plain_ms": 1600.0,
                "rows": [["aten::bmm [[8, 128, 50257], [8, 50257, 128]]", 150.0, 0.0, 1.0, 0.0]],
            }
        },  # fmt: skip
    }


def test_markdown_holds_the_command_and_the_recorded_numbers(monkeypatch):
    text = load_bench(monkeypatch, "users_paths_report").markdown(record())
    assert "python bench/users_paths.py --model gpt2 --seq-len 128 --batch-size 8 --clipping mixed" in text
    assert "| hf-dp-mixed | 15 | 220 | 230 | 1.10 | 1.08-1.13 |" in text
    assert "| hf-plain | 15 | 200 | 210 | 1.00 | - |" in text
    assert "| clip (backward) | 1000 (60.6%) |" in text
    assert "| plain step of the path (median) | 1600 |" in text
    assert "profiled totals 1800 ms against 1600 ms, 1.12x" in text
    assert "| `aten::bmm [[8, 128, 50257], [8, 50257, 128]]` | 150.0 | 150.0 | 0.0 | 1 / 0 |" in text


def test_render_replaces_only_the_marked_section(monkeypatch, tmp_path):
    bench = load_bench(monkeypatch, "users_paths_report")
    text = render_into_scratch_page(bench, monkeypatch, tmp_path, record())
    assert text.startswith(f"intro\n{bench.START}\n**gpt2, T=128, B=8**") and text.endswith(f"{bench.END}\nend\n")
    assert "old" not in text


def test_breakdown_drives_the_engine_as_the_strategy_calls_it(monkeypatch):
    """The breakdown's timing wrappers replace engine methods: they must take every argument the strategy passes
    (a short digits run, one round of two steps; only the parts are checked, no timing)."""
    import argparse

    bench = load_bench(monkeypatch, "users_paths")
    args = argparse.Namespace(
        model="digits", paths=["lightning"], clipping=["flat"], rounds=1, steps_per_round=2, skip_first=1,
        batch_size=128, seq_len=128, device="cpu", threads=1, no_breakdown=False, profile=0,
    )  # fmt: skip
    out = bench.run(args)
    assert len(out["results"]["lightning-dp-flat"]["round_ratios"]) == 1  # one round, its ratio of medians
    assert "round_ratios" not in out["results"]["lightning-plain"]
    parts = out["breakdown"]["lightning-dp-flat"]
    assert set(bench.PARTS) <= set(parts) and parts["step"] > 0 and parts["examples"] == 128
    assert out["profile"] == {}


def test_profile_ranks_the_operators_dp_adds_over_its_plain_path(monkeypatch):
    """``--profile N``: one more round per variant under the torch profiler, the first step of each left out; per DP
    variant the N operators with the most extra self time over the plain variant of its path (no timing checked)."""
    import argparse

    bench = load_bench(monkeypatch, "users_paths")
    args = argparse.Namespace(
        model="digits", paths=["lightning"], clipping=["flat"], rounds=1, steps_per_round=2, skip_first=1,
        batch_size=128, seq_len=128, device="cpu", threads=1, no_breakdown=True, profile=3,
    )  # fmt: skip
    profiled = bench.run(args)["profile"]
    assert list(profiled) == ["lightning-dp-flat"]
    rows = profiled["lightning-dp-flat"]["rows"]
    assert len(rows) == 3 and all(isinstance(row[0], str) for row in rows)
    extras = [dp - plain for _, dp, plain, _, _ in rows]
    assert extras == sorted(extras, reverse=True)
    assert profiled["lightning-dp-flat"]["dp_ms"] > 0 and profiled["lightning-dp-flat"]["plain_ms"] > 0


def test_extra_operators_compares_per_key_and_keeps_the_calls(monkeypatch):
    load_bench(monkeypatch, "users_paths")  # puts bench/ on the path
    from step_profile import extra_operators

    dp = {"aten::bmm [[8, 4]]": [5.0, 0.0, 2.0], "aten::mm": [10.0, 0.0, 3.0], "aten::normal_": [2.0, 0.0, 1.0]}
    plain = {"aten::mm": [9.0, 0.0, 3.0], "aten::fill_": [1.0, 0.0, 1.0]}
    out = extra_operators(dp, plain, device=False, top=3)
    assert out["dp_ms"] == 17.0 and out["plain_ms"] == 10.0
    assert out["rows"] == [
        ["aten::bmm [[8, 4]]", 5.0, 0.0, 2.0, 0.0],
        ["aten::normal_", 2.0, 0.0, 1.0, 0.0],
        ["aten::mm", 10.0, 9.0, 3.0, 3.0],
    ]


def test_the_docs_page_is_the_rendering_of_the_committed_records(monkeypatch) -> None:
    page, rendered = page_and_rendering(
        load_bench(monkeypatch, "users_paths_report"), "python bench/users_paths.py --model digits --record digits"
    )
    assert page == rendered
