"""bench/sst2_hf.py renders the SST-2 section of docs/hf.md only from the example's recorded JSON (the runs need the
SST-2 copy and the packaged encoder; not run here)."""

from __future__ import annotations

import json

import pytest
from bench_helpers import committed_records, load_bench, page_section

COMMAND = "python -m lightning_dp.examples.sst2_hf --seed {seed} {flags} --results-file docs/bench/sst2_hf/{name}.json"


def _record(seed: int, accuracy: float, dp: bool, threads: int = 2) -> dict:
    record = {"dp": dp, "train_size": 4000, "epochs": 3.0, "lr": 0.03, "pooling": "mean", "batch": 256,
              "trained": "head", "trained_params": 770, "dev_accuracy": accuracy,
              "majority_class": 0.5091743}  # fmt: skip
    if dp:
        record |= {"epsilon": 2.9977, "delta": 1.0907e-4, "noise": "gaussian", "noise_multiplier": 0.9435,
                   "max_grad_norm": 1.0, "steps": 48, "sample_rate": 0.064, "accountant": "pld",
                   "clipping": "ghost"}  # fmt: skip
    name = f"{'dp' if dp else 'non-dp'}.seed{seed}"
    flags = f"--dp-seed {seed}" if dp else "--disable-dp"
    environment = {"python": "3.11.7", "torch": "2.13.0+cpu", "numpy": "2.4.6", "threads": threads,
                   "cpu_capability": "AVX512", "device_name": "AMD EPYC"}  # fmt: skip
    return {**record, "seed": seed, "dp_seed": seed if dp else None, "environment": environment,
            "command": COMMAND.format(seed=seed, flags=flags, name=name)}  # fmt: skip


def test_the_table_sets_the_seeds_side_by_side_with_their_mean_and_sample_std(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "sst2_hf")
    records = [_record(0, 0.80, True), _record(1, 0.78, True), _record(0, 0.79, False), _record(1, 0.79, False)]
    text = bench.markdown(records)
    assert "| 0 | 80.00% | 79.00% |\n| 1 | 78.00% | 79.00% |" in text
    assert "| mean +- std (2 seeds) | 79.00 +- 1.41% | 79.00 +- 0.00% |" in text  # sample std: sqrt(2) points
    assert "The DP mean minus the non-DP mean: +0.00 points, against standard deviations of 1.41 (DP)" in text
    assert "All DP runs: sigma = 0.944, 48 steps at sample rate q = 0.064, clipping bound C = 1" in text
    assert "epsilon spent 3.00 at delta = 0.000109 (pld accountant)" in text
    # sigma C / (q N) = 0.9435 / 256 per coordinate; times sqrt(770) over the head
    assert "std sigma C / (q N) = 0.0037 per coordinate, norm about 0.10 over the trained parameters" in text
    assert "the majority class is 50.9% of the dev sentences" in text
    assert "torch 2.13.0+cpu, numpy 2.4.6, Python 3.11.7, CPU AMD EPYC (AVX512 kernels), 2 threads" in text
    assert "OMP_NUM_THREADS=2 python -m lightning_dp.examples.sst2_hf --seed 1 --dp-seed 1 --results-file" in text
    assert text.endswith("--disable-dp --results-file docs/bench/sst2_hf/non-dp.seed1.json\n```")


def test_a_seed_recorded_on_one_side_only_is_shown_and_counted(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "sst2_hf")
    text = bench.markdown([_record(0, 0.80, True), _record(1, 0.78, True, threads=1), _record(0, 0.79, False)])
    assert "| 1 | 78.00% | - |" in text
    assert "| mean +- std over the seeds | 79.00 +- 1.41% (2 seeds) | 79.00 +- 0.00% (1 seed) |" in text
    assert "1 to 2 threads" in text and "OMP_NUM_THREADS=1 python -m" in text
    assert bench.markdown([]) == "(no run recorded yet)"
    with pytest.raises(ValueError, match="more than one record of seed 0"):
        bench.markdown([_record(0, 0.80, True), _record(0, 0.81, True)])


def test_render_puts_the_records_between_the_markers(monkeypatch, tmp_path) -> None:
    bench = load_bench(monkeypatch, "sst2_hf")
    records = tmp_path / "records"
    records.mkdir()
    for record in (_record(0, 0.80, True), _record(0, 0.79, False)):
        (records / f"{'dp' if record['dp'] else 'non-dp'}.seed0.json").write_text(json.dumps(record))
    page = tmp_path / "page.md"
    page.write_text(f"intro\n{bench.START}\n(no run recorded yet)\n{bench.END}\nend\n")
    monkeypatch.setattr(bench, "RECORDS", records)
    monkeypatch.setattr(bench, "PAGE", page)
    bench.render()
    assert page_section(bench) == bench.markdown(bench.load_records())
    assert page.read_text().startswith(f"intro\n{bench.START}\n| seed |") and page.read_text().endswith("end\n")


def test_the_docs_page_is_the_rendering_of_the_committed_records(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "sst2_hf")
    committed_records(bench, "python -m lightning_dp.examples.sst2_hf ... --results-file docs/bench/sst2_hf/NAME.json")
    assert page_section(bench) == bench.markdown(bench.load_records())
