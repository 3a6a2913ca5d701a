"""bench/de_techniques.py renders docs/de_techniques.md (and its figure) only from its recorded JSON, and completes a
record with only the runs it lacks (``--missing``; no training is run here: the runs are stubbed)."""

from __future__ import annotations

import json
import sys

import pytest
from bench_helpers import load_bench, page_and_rendering, render_page_and_figure

ENVIRONMENT = {"python": "3.11.7", "torch": "2.13.0+cpu", "numpy": "2.4.6", "threads": 2, "cpu_capability": "AVX512",
               "device_name": "AMD EPYC", "platform": "Linux", "cpu_count": 2, "load_before": 2.5}  # fmt: skip


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
        "environment": {**ENVIRONMENT, "load_after": 2.5},
        "runs": runs,
    }


def run(k: int, seed: int, raw: float, ema: float, seconds: float, **augment: bool) -> dict:
    """A recorded run; ``augment=...`` as recorded since the option (without: a record from before, K > 1 augments)."""
    return {"k": k, **augment, "seed": seed, "raw_acc": raw, "ema_acc": ema, "ema_raw_distance": 1.5, "epsilon": 2.999,
            "noise_multiplier": 0.8123, "steps": 40, "sample_rate": 0.0256, "train_seconds": seconds,
            "run_seconds": seconds + 10, "train_cpu_seconds": seconds, "run_cpu_seconds": seconds + 10}  # fmt: skip


RUNS = [run(1, 0, 20.0, 22.0, 10.0), run(4, 0, 24.0, 25.0, 40.0), run(1, 1, 24.0, 25.0, 12.0),
        run(4, 1, 26.0, 28.0, 44.0)]  # fmt: skip


def test_rows_pair_raw_and_ema_of_the_same_runs(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "de_techniques")
    text = bench.markdown(record(RUNS))
    # K = 1: raw 20, 24 -> 22 +- 2.83; EMA 22, 25 -> 23.5 +- 2.12; paired differences 2, 1 -> +1.5 +- 0.71
    assert "| 1, no augmentation | 22.00 +- 2.83 | 23.50 +- 2.12 | +1.50 +- 0.71 | 2.999 | 0.8123 | 11 | 21 |" in text
    assert "| 4 | 25.00 +- 1.41 | 26.50 +- 2.12 | +1.50 +- 0.71 | 2.999 | 0.8123 | 42 | 52 |" in text
    assert text.index("| 1, no augmentation |") < text.index("| 4 |")
    assert "python bench/de_techniques.py --seeds 0 1" in text
    assert "40 steps of expected batch 128, target epsilon 3, EMA decay 0.9 from step 10" in text
    assert "2.4 minutes in all" in text  # (20 + 50 + 22 + 54) / 60 s


def test_augmented_k_one_is_a_row_of_its_own(monkeypatch) -> None:
    """Runs recorded with ``augment``: K = 1 augmented is its own row, apart from the un-augmented K = 1 (whose runs
    may lack the entry, as recorded before the option); the figure draws both."""
    bench = load_bench(monkeypatch, "de_techniques")
    runs = [*RUNS, run(1, 0, 30.0, 31.0, 11.0, augment=True), run(1, 1, 32.0, 35.0, 13.0, augment=True)]
    text = bench.markdown(record(runs))
    assert "| 1, no augmentation | 22.00 +- 2.83 | 23.50 +- 2.12 |" in text
    assert "| 1, augmented | 31.00 +- 1.41 | 33.00 +- 2.83 | +2.00 +- 1.41 | 2.999 | 0.8123 | 12 | 22 |" in text
    assert [row["augment"] for row in bench.rows(record(runs))] == [False, True, True]
    assert [bench.augmented(r) for r in (run(1, 0, 1, 1, 1), run(4, 0, 1, 1, 1), run(1, 0, 1, 1, 1, augment=True))] == [
        False,
        True,
        True,
    ]


def _stub_runs(monkeypatch, bench, tmp_path, existing: dict) -> list[tuple[int, bool, int]]:
    """The bench writing to ``tmp_path``, with ``existing`` as the record ``cpu``, the environment of
    :data:`ENVIRONMENT` at a higher load, and ``run_one`` stubbed: the ``(K, augment, seed)`` it is called with."""
    records = tmp_path / "records"
    records.mkdir()
    (records / "cpu.json").write_text(json.dumps(existing))
    page = tmp_path / "page.md"
    page.write_text(f"{bench.START}\n{bench.END}\n")
    for name, value in (("ROOT", tmp_path), ("RECORDS", records), ("PAGE", page), ("FIGURE", tmp_path / "fig.png")):
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr(bench, "environment", lambda device: {**ENVIRONMENT, "platform": "other", "load_before": 8.0})
    called = []

    def run_one(args, k: int, augment: bool, seed: int) -> dict:
        called.append((k, augment, seed))
        return run(k, seed, 40.0 + seed, 41.0, 20.0, augment=augment)

    monkeypatch.setattr(bench, "run_one", run_one)
    return called


def test_missing_runs_only_what_the_record_lacks_and_merges_it(monkeypatch, tmp_path, capsys) -> None:
    """``--missing --record cpu`` on a record of K = 1, 4 made before the augmented K = 1: only the augmented K = 1
    runs are made, merged in the order a full run makes them; the record states the command without ``--missing``
    (which makes every run), keeps its environment, and lists the completion; the page marks the added seconds."""
    bench = load_bench(monkeypatch, "de_techniques")
    called = _stub_runs(monkeypatch, bench, tmp_path, record(RUNS))
    argv = ["--seeds", "0", "1", "--ks", "1", "4", "--missing", "--record", "cpu"]
    monkeypatch.setattr(sys, "argv", ["bench/de_techniques.py", *argv])
    bench.main(argv)
    assert called == [(1, True, 0), (1, True, 1)]
    written = json.loads((tmp_path / "records" / "cpu.json").read_text())
    assert written["command"] == "python bench/de_techniques.py --seeds 0 1 --ks 1 4"
    assert [(r["k"], bench.augmented(r), r["seed"]) for r in written["runs"]] == [
        (k, augment, seed) for seed in (0, 1) for k, augment in ((1, False), (1, True), (4, True))
    ]
    assert written["runs"][0] == RUNS[0] and written["environment"] == record(RUNS)["environment"]
    assert written["args"]["missing"] is False and written["args"]["augmented_k1"] is True
    (addition,) = written["additions"]
    assert addition["command"] == "python bench/de_techniques.py " + " ".join(argv)
    assert addition["runs"] == [[1, True, 0], [1, True, 1]] and addition["environment"]["load_before"] == 8.0
    page = (tmp_path / "page.md").read_text()
    assert "| 1, augmented | 40.50 +- 0.71 | 41.00 +- 0.00 | +0.50 +- 0.71 | 2.999 | 0.8123 | 20\\* | 30\\* |" in page
    assert "| 4 | 25.00 +- 1.41 | 26.50 +- 2.12 | +1.50 +- 0.71 | 2.999 | 0.8123 | 42 | 52 |" in page
    assert (
        "\\* Added to the record by `python bench/de_techniques.py --seeds 0 1 --ks 1 4 --missing --record cpu`" in page
    )
    assert "(K = 1, augmented; seeds [0, 1])" in page and "load average of 8.0 (the record's runs: 2.5)" in page
    called.clear()
    bench.main(argv)  # complete: nothing left to run, the record unchanged
    assert called == [] and json.loads((tmp_path / "records" / "cpu.json").read_text()) == written
    capsys.readouterr()


@pytest.mark.parametrize(
    ("change", "extra", "message"),
    [
        ({"args": {**record([])["args"], "steps": 20}}, [], r"another setup than this command: {'steps': \(20, 40\)}"),
        ({"environment": {**ENVIRONMENT, "threads": 1}}, [], "another environment than this command"),
        ({}, ["--ks", "1"], r"other runs than this command: \[\(4, True, 0\)"),
        # an older record lacking an entry: refused as another setup or environment (not a KeyError), even where the
        # command's value is None (the default --eval-size)
        (
            {"args": {key: value for key, value in record([])["args"].items() if key != "eval_size"}},
            [],
            r"another setup than this command: {'eval_size': \('\(not recorded\)', None\)}",
        ),
        (
            {"environment": {key: value for key, value in ENVIRONMENT.items() if key != "cpu_capability"}},
            [],
            r"another environment than this command: {'cpu_capability': \('\(not recorded\)', 'AVX512'\)}",
        ),
    ],
)
def test_missing_refuses_a_record_it_cannot_complete(monkeypatch, tmp_path, change, extra, message) -> None:
    bench = load_bench(monkeypatch, "de_techniques")
    called = _stub_runs(monkeypatch, bench, tmp_path, {**record(RUNS), **change})
    with pytest.raises(SystemExit, match=message):
        bench.main(["--seeds", "0", "1", *extra, "--missing", "--record", "cpu"])
    assert called == []


@pytest.mark.parametrize(
    ("entry", "value"), [("noise_multiplier", 0.8124), ("epsilon", 3.0), ("sample_rate", 0.0512), ("steps", 39)]
)
def test_missing_refuses_a_new_run_of_other_privacy_quantities(monkeypatch, tmp_path, entry, value) -> None:
    """Same setup and environment, but the first new run's noise multiplier, epsilon, sample rate or steps is not
    exactly the recorded runs' (other code or data): refused at that run, the record left as it was."""
    bench = load_bench(monkeypatch, "de_techniques")
    called = _stub_runs(monkeypatch, bench, tmp_path, record(RUNS))
    stubbed = bench.run_one
    monkeypatch.setattr(bench, "run_one", lambda *arguments: {**stubbed(*arguments), entry: value})
    before = (tmp_path / "records" / "cpu.json").read_text()
    with pytest.raises(SystemExit, match="other code or data; re-run the whole record without --missing") as refusal:
        bench.main(["--seeds", "0", "1", "--ks", "1", "4", "--missing", "--record", "cpu"])
    assert f"{entry!r}: ([{RUNS[0][entry]!r}], {value!r})" in str(refusal.value)
    assert called == [(1, True, 0)] and (tmp_path / "records" / "cpu.json").read_text() == before


def test_reproducing_argv_drops_the_record_flags(monkeypatch) -> None:
    """``records.reproducing_argv``, shared by ``records.finish`` and the completion: ``--json``, ``--record NAME``
    and ``--record=NAME`` always dropped, ``--missing`` only when asked."""
    load_bench(monkeypatch, "de_techniques")  # bench/ on the path
    import records

    argv = ["--seeds", "0", "--missing", "--record", "cpu", "--json", "--steps", "2"]
    assert records.reproducing_argv(argv) == ["--seeds", "0", "--missing", "--steps", "2"]
    assert records.reproducing_argv(argv, drop=("--missing",)) == ["--seeds", "0", "--steps", "2"]
    assert records.reproducing_argv(["--record=cpu", "--missing"], drop=("--missing",)) == []


def test_render_fills_the_markers_and_draws_the_figure(monkeypatch, tmp_path) -> None:
    bench = load_bench(monkeypatch, "de_techniques")
    text = render_page_and_figure(bench, monkeypatch, tmp_path, "cpu", record(RUNS))
    assert text == f"intro\n{bench.START}\n{bench.markdown(record(RUNS))}\n{bench.END}\nend\n"
    assert (tmp_path / "figure.png").read_bytes().startswith(b"\x89PNG")


def test_smoke_options_parse(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "de_techniques")
    args = bench.parse_args(["--steps", "2", "--ks", "1", "2", "--seeds", "0", "--eval-size", "1000"])
    assert (args.steps, args.ks, args.seeds, args.eval_size, args.ema_start) == (2, [1, 2], [0], 1000, 0)
    assert bench.variants(args) == [(1, False), (1, True), (2, True)]
    assert bench.variants(bench.parse_args(["--ks", "4", "1", "--no-augmented-k1"])) == [(1, False), (4, True)]
    assert bench.parse_args([]).ema_start == 10  # a quarter of the 40 default steps
    for bad in (["--ema-decay", "1"], ["--missing"], ["--missing", "--record", "cpu", "--render"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_the_docs_page_is_the_rendering_of_the_committed_records(monkeypatch) -> None:
    page, rendered = page_and_rendering(
        load_bench(monkeypatch, "de_techniques"), "python bench/de_techniques.py --seeds 0 1 2 --record cpu"
    )
    assert page == rendered
