"""bench/de_techniques.py renders docs/de_techniques.md (and its figure) only from its recorded JSON (no training is
run here)."""

from __future__ import annotations

import json

import pytest
from bench_helpers import load_bench


def record(runs: list[dict]) -> dict:
    return {
        "command": "python bench/de_techniques.py --seeds 0 1",
        "args": {
            "ks": [1, 4],
            "seeds": [0, 1],
            "steps": 40,
            "batch_size": 128,
            "target_epsilon": 3.0,
            "ema_decay": 0.9,
            "ema_start": 10,
            "eval_size": None,
        },
        "environment": {"torch": "2.13.0+cpu", "threads": 2},
        "runs": runs,
    }


def run(k: int, seed: int, raw: float, ema: float, seconds: float) -> dict:
    return {"k": k, "seed": seed, "raw_acc": raw, "ema_acc": ema, "ema_raw_distance": 1.5, "epsilon": 2.999,
            "noise_multiplier": 0.8123, "steps": 40, "sample_rate": 0.0256, "train_seconds": seconds,
            "run_seconds": seconds + 10, "train_cpu_seconds": seconds, "run_cpu_seconds": seconds + 10}  # fmt: skip


RUNS = [run(1, 0, 20.0, 22.0, 10.0), run(4, 0, 24.0, 25.0, 40.0), run(1, 1, 24.0, 25.0, 12.0),
        run(4, 1, 26.0, 28.0, 44.0)]  # fmt: skip


def test_rows_pair_raw_and_ema_of_the_same_runs(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "de_techniques")
    text = bench.markdown(record(RUNS))
    # K = 1: raw 20, 24 -> 22 +- 2.83; EMA 22, 25 -> 23.5 +- 2.12; paired differences 2, 1 -> +1.5 +- 0.71
    assert "| 1 | 22.00 +- 2.83 | 23.50 +- 2.12 | +1.50 +- 0.71 | 2.999 | 0.8123 | 11 | 21 |" in text
    assert "| 4 | 25.00 +- 1.41 | 26.50 +- 2.12 | +1.50 +- 0.71 | 2.999 | 0.8123 | 42 | 52 |" in text
    assert text.index("| 1 |") < text.index("| 4 |")
    assert "python bench/de_techniques.py --seeds 0 1" in text
    assert "40 steps of expected batch 128, target epsilon 3, EMA decay 0.9 from step 10" in text
    assert "2.4 minutes in all" in text  # (20 + 50 + 22 + 54) / 60 s


def test_render_fills_the_markers_and_draws_the_figure(monkeypatch, tmp_path) -> None:
    bench = load_bench(monkeypatch, "de_techniques")
    records = tmp_path / "records"
    records.mkdir()
    (records / "cpu.json").write_text(json.dumps(record(RUNS)))
    page = tmp_path / "page.md"
    page.write_text(f"intro\n{bench.START}\n(no run recorded yet)\n{bench.END}\nend\n")
    for name, value in (("RECORDS", records), ("PAGE", page), ("FIGURE", tmp_path / "figure.png")):
        monkeypatch.setattr(bench, name, value)
    bench.render()
    text = page.read_text()
    assert text == f"intro\n{bench.START}\n{bench.markdown(record(RUNS))}\n{bench.END}\nend\n"
    assert (tmp_path / "figure.png").read_bytes().startswith(b"\x89PNG")


def test_smoke_options_parse(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "de_techniques")
    args = bench.parse_args(["--steps", "2", "--ks", "1", "2", "--seeds", "0", "--eval-size", "1000"])
    assert (args.steps, args.ks, args.seeds, args.eval_size, args.ema_start) == (2, [1, 2], [0], 1000, 0)
    assert bench.parse_args([]).ema_start == 10  # a quarter of the 40 default steps
    with pytest.raises(SystemExit):
        bench.parse_args(["--ema-decay", "1"])


def test_the_docs_page_is_the_rendering_of_the_committed_records(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "de_techniques")
    records = sorted(bench.RECORDS.glob("*.json"))
    section = bench.PAGE.read_text().split(bench.START, 1)[1].split(bench.END, 1)[0].strip("\n")
    if not records:
        assert section == "(no run recorded yet)"  # what render_records writes without a record
        pytest.skip("docs/bench/de_techniques/ holds no record yet: run python bench/de_techniques.py --record cpu")
    rendered = "\n\n".join(bench.markdown(json.loads(path.read_text())) for path in records)
    assert section == rendered
