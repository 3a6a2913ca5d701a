"""bench/fallback_cost.py: its variants take the same step, it runs in a tiny configuration and reports every field,
and its docs section is the rendering of the recorded JSON (no timing is asserted)."""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from bench_helpers import ROOT, load_bench, page_and_rendering, render_into_scratch_page

MIB = 2**20
TINY = ["--dim", "16", "--hidden", "32", "--blocks", "1", "--seq-len", "4", "--batch-size", "2", "--steps", "1"]


def _run_script(*extra: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "bench/fallback_cost.py", *TINY, "--warmup", "0", "--json", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_our_variants_take_the_same_step_through_families_and_fallback(monkeypatch, caplog) -> None:
    bench = load_bench(monkeypatch, "fallback_cost")
    args = argparse.Namespace(dim=8, hidden=12, blocks=2, seq_len=3, batch_size=4)
    built = bench.build_models(args, torch.device("cpu"), ["nn", "norm", "linear"])
    models = {layers: model.double() for layers, model in built.items()}
    inputs, target = (x.double() for x in bench._data(args, torch.device("cpu")))
    after = {}
    with caplog.at_level(logging.INFO, logger="lightning_dp"):
        for variant in ("family", "fallback-norm", "fallback-linear"):
            model = copy.deepcopy(models[bench.LAYERS[variant]])
            bench.make_step(variant, model, inputs, target, "mixed")()  # one DP step, the same noise seed
            after[variant] = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.allclose(after["fallback-norm"], after["family"], rtol=0, atol=1e-12)
    assert torch.allclose(after["fallback-linear"], after["family"], rtol=0, atol=1e-12)
    served = [r.getMessage() for r in caplog.records if "exact torch.func fallback" in r.getMessage()]
    assert len(served) == 2 and "OwnLayerNorm" in served[0] and "OwnLinear" not in served[0]
    assert "'blocks.0.up' (OwnLinear" in served[1]


def test_the_script_runs_every_variant_and_reports_the_ratios(monkeypatch) -> None:
    record = _run_script("--no-memory")
    assert record["command"].startswith("python bench/fallback_cost.py --dim 16") and "--json" not in record["command"]
    assert record["order"] == list(load_bench(monkeypatch, "fallback_cost").VARIANTS)
    results = record["results"]
    for variant, row in results.items():
        assert {"seconds", "cpu_seconds"} <= row.keys(), variant
        assert {"time_ratio", "time_vs_family"} <= row.keys() and "peak_bytes" not in row, variant
        assert ("time_vs_opacus" in row) == (variant in ("family", "fallback-norm", "fallback-linear")), variant
    assert results["non-private"]["time_ratio"] == 1.0 and results["family"]["time_vs_family"] == 1.0
    assert results["fallback-norm"]["time_vs_opacus"] == pytest.approx(
        results["fallback-norm"]["cpu_seconds"] / results["opacus-functorch-norm"]["cpu_seconds"]
    )
    bench = load_bench(monkeypatch, "fallback_cost")
    report = bench.report_lines(record)
    assert report[0].startswith("d=16 hidden=32 blocks=1 T=4 B=2 clipping=mixed device=cpu threads=1 steps=1")
    assert [line.split()[0] for line in report[2:]] == record["order"]
    assert "| fallback-linear | " in bench.markdown(record)


def test_the_script_measures_each_variants_memory_in_a_fresh_process() -> None:
    results = _run_script("--variants", "fallback-norm")["results"]
    assert list(results) == ["non-private", "fallback-norm"]
    assert results["non-private"]["memory_ratio"] == 1.0
    assert results["fallback-norm"]["peak_bytes"] > 0 and "memory_ratio" in results["fallback-norm"]
    assert "memory_vs_family" not in results["fallback-norm"]  # no family variant in this run


def record() -> dict:
    row = {"seconds": 0.5, "cpu_seconds": 0.4, "peak_bytes": 100 * MIB, "time_ratio": 1.0, "memory_ratio": 1.0}
    fallback = {
        "seconds": 1.2, "cpu_seconds": 1.0, "peak_bytes": 150 * MIB, "time_ratio": 2.5, "memory_ratio": 1.5,
        "time_vs_family": 2.0, "memory_vs_family": 1.25, "time_vs_opacus": 0.8, "memory_vs_opacus": 0.9,
    }  # fmt: skip
    return {
        "command": "python bench/fallback_cost.py --threads 2 --variants family fallback-linear",
        "args": {
            "dim": 256,
            "hidden": 1024,
            "blocks": 4,
            "seq_len": 64,
            "batch_size": 16,
            "clipping": "mixed",
            "device": "cpu",
            "threads": 2,
            "steps": 5,
            "warmup": 1,
        },  # fmt: skip
        "environment": {"torch": "2.13.0+cpu", "device_name": "Some CPU", "load_before": 0.5, "load_after": 1.0},
        "order": ["non-private", "family", "fallback-linear", "opacus-functorch"],
        "results": {
            "non-private": row,
            "family": {**row, "time_ratio": 1.25, "memory_ratio": 1.2, "time_vs_family": 1.0},
            "fallback-linear": fallback,
            "opacus-functorch": {"error": "RuntimeError: refused"},
        },
    }


def test_markdown_holds_the_set_up_the_command_and_the_recorded_numbers(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "fallback_cost")
    text = bench.markdown(record())
    assert text.startswith("**d=256, hidden 1024, 4 blocks, T=64, B=16, clipping=mixed** (Some CPU, torch 2.13.0+cpu, ")
    assert "2 intra-op threads, load average 0.50 before / 1.00 after; median of 5 interleaved steps" in text
    assert "after 1 left out; time ratios of cpu time)" in text
    assert "python bench/fallback_cost.py --threads 2 --variants family fallback-linear" in text
    assert "| fallback-linear | 1200 | 1000 | 2.50 | 2.00 | 0.80 | 150.0 | 1.50 | 1.25 | 0.90 |" in text
    assert "| family | 500 | 400 | 1.25 | 1.00 | - | 100.0 | 1.20 | - | - |" in text
    assert "| opacus-functorch | RuntimeError: refused |" in text
    cuda = record()
    cuda["args"]["device"] = "cuda"
    assert "time ratios of wall time" in bench.markdown(cuda) and "intra-op" not in bench.markdown(cuda)


def test_render_replaces_only_the_marked_section(monkeypatch, tmp_path) -> None:
    bench = load_bench(monkeypatch, "fallback_cost")
    text = render_into_scratch_page(bench, monkeypatch, tmp_path, record())
    assert text.startswith(f"intro\n{bench.START}\n**d=256, hidden 1024") and text.endswith(f"{bench.END}\nend\n")


def test_the_docs_page_is_the_rendering_of_the_committed_records(monkeypatch) -> None:
    page, rendered = page_and_rendering(
        load_bench(monkeypatch, "fallback_cost"), "python bench/fallback_cost.py --threads 2 --record NAME"
    )
    assert page == rendered
