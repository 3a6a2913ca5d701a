"""bench/gpu.py: its toy mode runs every model and variant end to end on the CPU and writes a complete record, the DP
steps under HF's non-reentrant activation checkpointing are those without it, and its docs section is the rendering
of the recorded JSON, or says that none was recorded (no timing is asserted)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import subprocess
import sys

import pytest
import torch
from bench_helpers import ROOT, load_bench, page_section, render_into_scratch_page

GIB = 2**30
STATUSES = {"ok", "refused", "failed", "out of memory", "skipped"}


def _run_toy(tmp_path) -> tuple[dict, dict]:
    """The toy run of every model and variant (one timed step, memory and the batch probe): the record printed with
    ``--json`` and the one written to ``--out``."""
    out = tmp_path / "toy.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, "bench/gpu.py", "--toy", "--device", "cpu", "--steps", "1", "--json", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1]), json.loads(out.read_text())


def test_the_toy_mode_runs_every_model_and_variant_and_records_finite_ratios(monkeypatch, tmp_path) -> None:
    bench = load_bench(monkeypatch, "gpu")
    printed, written = _run_toy(tmp_path)
    assert written["models"] == printed["models"] and written["batch_probe"] == printed["batch_probe"]
    command, environment = printed["command"], printed["environment"]
    assert command.startswith("python bench/gpu.py --toy --device cpu") and "--json" not in command
    assert printed["args"]["size"] == "toy" and {"torch", "transformers", "opacus", "peft"} <= environment.keys()
    assert printed["order"] == list(bench.VARIANTS) and list(printed["models"]) == list(bench.MODELS)
    for name, model in printed["models"].items():
        results = model["results"]
        assert list(results) == list(bench.VARIANTS), name
        assert model["spec"]["batch_size"] == 2 and model["engines"]["dp-auto"] in ("mixed", "ghost", "flat"), name
        assert all(row["status"] in STATUSES for row in results.values()), name
        assert results["non-private"]["time_vs_non_private"] == 1.0, name
        for variant in ("dp-auto", "dp-ghost", "dp-flat"):  # ours run on every model, checkpointing and LoRA included
            row = results[variant]
            assert row["status"] == "ok" and row["timed_steps"] == 1, (name, variant, row)
            assert math.isfinite(row["time_vs_non_private"]) and math.isfinite(row["memory_vs_non_private"])
            assert row["peak_total_bytes"] >= row["peak_bytes"] >= row.get("steady_peak_bytes", 0), (name, variant)
            for opacus in ("opacus-flat", "opacus-ghost"):
                key = f"time_vs_{opacus.replace('-', '_')}"
                assert (key in row) == (results[opacus]["status"] == "ok"), (name, variant, opacus)
                assert key not in row or math.isfinite(row[key])
        for variant in ("opacus-flat", "opacus-ghost"):  # run or say why not
            row = results[variant]
            assert row["status"] == "ok" or row["error"], (name, variant)
    gpt2 = printed["models"]["gpt2"]["results"]
    assert gpt2["opacus-flat"]["status"] == "ok" and "time_vs_opacus_flat" in gpt2["dp-auto"]
    assert gpt2["opacus-ghost"]["status"] == "failed" and "tying" in gpt2["opacus-ghost"]["error"]
    # position_ids with rows of their own, which Opacus's ghost clipping can view (an expanded tensor failed)
    assert printed["models"]["bert"]["results"]["opacus-ghost"]["status"] == "ok"
    probe = printed["batch_probe"]
    assert [entry["batch_size"] for entry in probe["probes"]] == [2, 4, 8]  # doubling from B=2 up to the toy's cap
    assert probe["largest_fits"] == 8 and probe["stopped"] == "reached --probe-max-batch 8"
    saving = printed["checkpointing_memory"]  # llama-1b without checkpointing, each variant in its own process
    assert saving["model"] == "llama-1b" and list(saving["results"]) == ["non-private", "dp-auto"]
    assert all(row["status"] == "ok" and row["peak_total_bytes"] > 0 for row in saving["results"].values())
    report = "\n".join(load_bench(monkeypatch, "gpu_report").report_lines(printed))
    assert "largest physical batch of llama-1b (dp-auto): 8" in report
    assert "What activation checkpointing saves (llama-1b" in report
    page = load_bench(monkeypatch, "gpu_report").markdown(printed)
    assert "| dp-auto | ok |" in page and "| peak GiB (extra) without checkpointing |" in page
    for name, model in printed["models"].items():  # the profile of dp-auto against non-private, per model
        profile = model["profile"]
        assert profile["dp_ms"] > 0 and profile["plain_ms"] > 0 and len(profile["rows"]) == 12, name
        extras = [dp - plain for _, dp, plain, _, _ in profile["rows"]]
        assert extras == sorted(extras, reverse=True), name
    assert "Where `dp-auto`'s extra CPU self time goes" in page


def test_the_gpu_session_script_runs_the_bench_and_the_cuda_tests(tmp_path) -> None:
    """scripts/gpu_session.sh, the one call on a lent GPU, runs here at toy size: the record and both logs under
    ``$OUT``, each part's exit status 0 (the CUDA tests skip on a CPU)."""
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    toy = "--toy --device cpu --steps 1 --models bert --no-memory --no-probe --profile 0".split()
    command = ["bash", "scripts/gpu_session.sh", *toy]
    subprocess.run(command, cwd=ROOT, env=env, capture_output=True, timeout=600, check=True)
    record = json.loads((tmp_path / "real.json").read_text())
    assert list(record["models"]) == ["bert"] and record["args"]["budget"] == 360
    assert "bench/gpu.py exit status: 0" in (tmp_path / "bench.log").read_text()
    tests = (tmp_path / "tests.log").read_text()
    assert "CUDA tests exit status: 0" in tests and " passed" in tests


def test_a_unit_that_raises_keeps_its_error_and_the_others_run(monkeypatch) -> None:
    """An out-of-memory build (or any error) in one model's run ended the whole GPU run (found in review)."""
    bench = load_bench(monkeypatch, "gpu")

    def run_model(name, *_):
        if name == "gpt2":
            raise torch.OutOfMemoryError("CUDA out of memory")
        return {"results": {}}

    monkeypatch.setattr(bench, "run_model", run_model)
    args = bench.parse_args(["--toy", "--device", "cpu", "--models", "gpt2", "bert", "--no-memory", "--no-probe"])
    out = bench.run(args)
    assert out["models"] == {"gpt2": {"error": "OutOfMemoryError: CUDA out of memory"}, "bert": {"results": {}}}


@pytest.mark.parametrize("name", ["llama-1b", "llama-1b-lora"])
def test_the_dp_step_under_activation_checkpointing_is_the_step_without_it(monkeypatch, name) -> None:
    """HF's non-reentrant activation checkpointing (on, as in the bench) recomputes the decoder layers in the backward;
    lightning_dp's clipping must capture the same activations and output gradients: every engine's DP step (the same
    noise seed) moves the weights exactly as without checkpointing (float64 toy Llama)."""
    bench = load_bench(monkeypatch, "gpu")
    logging.getLogger("lightning_dp").setLevel(logging.ERROR)
    spec = bench.model_spec(name, "toy")
    for variant in ("dp-auto", "dp-ghost", "dp-flat"):
        after, recomputed = {}, {}
        for checkpointing in (False, True):
            variant_spec = dataclasses.replace(spec, checkpointing=checkpointing, dtype=torch.float64)
            model = bench.build_model(variant_spec, torch.device("cpu"))
            calls: list[int] = []
            layer = model.get_base_model().model.layers[0] if spec.lora else model.model.layers[0]
            layer.mlp.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
            batch = bench.make_batch(variant_spec, torch.device("cpu"))
            bench.make_step(variant, variant_spec, model, batch)()
            after[checkpointing] = torch.cat([p.detach().flatten() for p in model.parameters() if p.requires_grad])
            recomputed[checkpointing] = len(calls)
        # every forward of the layer (the step's, and the attach probe's when the engine is built) ran again in the
        # backward: the checkpointing is on
        assert recomputed[True] == 2 * recomputed[False] > 0, (variant, recomputed)
        torch.testing.assert_close(after[True], after[False], rtol=0, atol=1e-12, msg=variant)


def record() -> dict:
    ok = {"status": "ok", "seconds": 0.2, "cpu_seconds": 0.19, "timed_steps": 5, "peak_bytes": 10 * GIB,
          "peak_total_bytes": 30 * GIB, "time_vs_non_private": 1.0, "memory_vs_non_private": 1.0}  # fmt: skip
    dp = {**ok, "seconds": 0.3, "peak_bytes": 11 * GIB, "peak_total_bytes": 31 * GIB, "time_vs_non_private": 1.5,
          "memory_vs_non_private": 1.1, "time_vs_opacus_flat": 0.75, "memory_vs_opacus_flat": 0.5}  # fmt: skip
    config = {"num_hidden_layers": 16, "hidden_size": 2048, "vocab_size": 128256}
    return {
        "command": "python bench/gpu.py --models llama-1b",
        "args": {"size": "real", "device": "cuda", "budget": 450.0, "steps": 5, "warmup": 1},
        "environment": {"torch": "2.13.0+cu130", "transformers": "5.24.0", "device_name": "NVIDIA H100 80GB HBM3"},
        "elapsed_seconds": 300.0,
        "order": ["non-private", "dp-auto", "opacus-flat", "opacus-ghost"],
        "models": {
            "llama-1b": {
                "spec": {
                    "kind": "causal-lm",
                    "batch_size": 4,
                    "seq_len": 2048,
                    "dtype": "bfloat16",
                    "checkpointing": True,
                    "lora": False,
                    "config": config,
                },
                "engines": {"dp-auto": "mixed"},
                "results": {
                    "non-private": ok,
                    "dp-auto": dp,
                    "opacus-flat": {**ok, "seconds": 0.4, "peak_bytes": 22 * GIB, "peak_total_bytes": 42 * GIB},
                    "opacus-ghost": {"status": "failed", "error": "NotImplementedError: Parameter tying"},
                },
            }
        },
        "batch_probe": {
            "model": "llama-1b",
            "variant": "dp-auto",
            "largest_fits": 16,
            "stopped": "out of memory at 32",
            "probes": [
                {"batch_size": 16, "status": "ok", "peak_bytes": GIB, "peak_total_bytes": 70 * GIB},
                {"batch_size": 32, "status": "out of memory", "error": "OutOfMemoryError: CUDA out of memory"},
            ],
        },
    }


def test_markdown_holds_the_command_the_model_and_the_recorded_numbers(monkeypatch) -> None:
    text = load_bench(monkeypatch, "gpu_report").markdown(record())
    assert text.startswith("**real sizes on NVIDIA H100 80GB HBM3** (torch 2.13.0+cu130, transformers 5.24.0;")
    assert "wall time between `torch.cuda.synchronize` calls" in text
    assert "```bash\npython bench/gpu.py --models llama-1b\n```" in text
    assert "**llama-1b** (causal-lm: 16 layers, hidden 2048, vocabulary 128256, T=2048, B=4; bfloat16, activation " \
           "checkpointing; `auto` ran `mixed`)" in text  # fmt: skip
    assert "| dp-auto | ok | 300 (5) | 1.50 | 0.75 | - | 31.00 (11.00) | 1.10 | 0.50 | - |" in text
    assert "| opacus-ghost | failed: NotImplementedError: Parameter tying | - |" in text
    assert "stopped: out of memory at 32): **16**" in text and "| 32 | out of memory: OutOfMemoryError" in text


def test_render_puts_the_records_or_says_none_was_recorded(monkeypatch, tmp_path) -> None:
    bench = load_bench(monkeypatch, "gpu_report")
    text = render_into_scratch_page(bench, monkeypatch, tmp_path, record())
    assert text.startswith(f"intro\n{bench.START}\n**real sizes on NVIDIA H100")
    assert text.endswith(f"{bench.END}\nend\n")
    (bench.RECORDS / "a.json").unlink()
    bench.render()
    text = bench.PAGE.read_text()
    assert f"{bench.START}\n{bench.NO_RECORD}\n{bench.END}" in text and "has not been recorded yet" in text


def test_the_docs_page_is_the_rendering_of_the_committed_records_or_says_there_is_none(monkeypatch) -> None:
    bench = load_bench(monkeypatch, "gpu_report")
    records = sorted(bench.RECORDS.glob("*.json"))
    expected = "\n\n".join(bench.markdown(json.loads(path.read_text())) for path in records) or bench.NO_RECORD
    assert page_section(bench) == expected, "run python bench/gpu.py --render"
