"""The GPU bench in one command: the full DP training step of models at real sizes, lightning_dp against
non-private training and Opacus, time and memory, in under 8 minutes on one H100/H200.

Models (bench/gpu_models.py, built from configs, no download): ``gpt2`` (GPT-2 124M, T=1024, B=8), ``llama-1b``
(Llama-3.2-1B's shape in bfloat16, T=2048, B=4, HF activation checkpointing, non-reentrant), ``llama-1b-lora`` (the
same with peft LoRA), ``bert`` (BERT-base sequence classification, T=128, B=64), ``vit`` (ViT-B/16 at 224 px, B=64).
``--size toy`` (or ``--toy``) builds tiny configs of the same classes and runs every code path on a CPU in seconds.

Variants (one copy of the model each, identical weights, the same batch): ``non-private`` (the mean loss, SGD);
``dp-auto``, ``dp-ghost``, ``dp-flat`` (lightning_dp's :class:`~lightning_dp.PrivacyEngine` driven as its trainer
adapters drive it, ``clipping=`` ``auto`` / ``ghost`` / ``flat``, C=1, Gaussian noise sigma=1; bench/timing.py's
``engine_step``); ``opacus-flat`` (Opacus 1.6 ``GradSampleModule``) and ``opacus-ghost``
(``GradSampleModuleFastGradientClipping``). A variant that refuses the model or fails keeps its error as its row's
status (``refused``: at the build; ``failed``: at a step; ``out of memory``; ``skipped``: the time budget).

Time: the full train step (forward, backward, clipping, noise, optimizer step, then ``zero_grad(set_to_none=True)``
so that the copies hold no gradients between steps) between ``torch.cuda.synchronize`` calls; all variants of a
model in one process, interleaved step by step, the order rotating every round; the median over the timed rounds
(``--steps``, fewer when the budget runs short; ``--warmup`` rounds left out). On CPU the ratios use CPU time.
Memory: each variant alone in a fresh process (forked from a server that imported the libraries once), two steps:
``torch.cuda.max_memory_allocated`` (CPU: the peak resident set), the peak itself and the peak over the model and
batch. Ratios against non-private and against each Opacus variant that ran, in the same run.
Profile (``--profile N``, default 2): per model, ``non-private`` and ``dp-auto`` each on its own copy, one step left
out, then ``N`` steps under the torch profiler; the operators ``dp-auto`` spends the most time on beyond the
non-private step (device time of their kernels on CUDA; bench/step_profile.py), within the model's time share.
Largest physical batch (``llama-1b``, ``dp-auto``): doubling from the timed batch, each size in its own process,
until out of memory, the budget or ``--probe-max-batch``. What checkpointing saves: the peak memory of ``llama-1b``
without activation checkpointing, ``non-private`` and ``dp-auto``, each in its own process, beside its rows with it.

Budget: ``--budget`` seconds (default 420) are shared among the models (``llama-*`` count double) and the batch
probe; a model's timing ends when its share's first 40 % is spent (at least one timed round), its memory
measurements are skipped once the share is spent (a measurement started is given at least 30 s), and the unspent
time passes to the next. With the imports and the last measurement's grace, the whole run stays under 8 minutes.

Usage: ``python bench/gpu.py`` (all models, CUDA; writes docs/bench/gpu/real.json and re-renders the "GPU at real
model sizes" section of docs/performance.md); ``python bench/gpu.py --toy --device cpu --steps 1`` (seconds);
``--models gpt2 bert``, ``--variants dp-auto opacus-flat``, ``--out PATH``, ``--json``; ``--render`` only re-renders.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib.metadata
import json
import logging
import os
import shlex
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from gpu_models import MODELS, SIZES, ModelSpec, build_model, loss_function, make_batch, model_spec
from gpu_report import END, PAGE, RECORDS, START, render, report_lines
from records import environment, reproducing_argv
from step_profile import StepProfiler, extra_operators
from timing import (
    Step,
    engine_step,
    measure_memory,
    opacus_ghost_step,
    opacus_step,
    plain_step,
    ratios,
    release,
    short_error,
    start_forkserver,
    time_interleaved,
)

from lightning_dp.utils.help_format import HelpFormatter

__all__ = ["END", "PAGE", "RECORDS", "START", "main", "render", "report_lines", "run"]

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("non-private", "dp-auto", "dp-ghost", "dp-flat", "opacus-flat", "opacus-ghost")
OPACUS = ("opacus-flat", "opacus-ghost")
#: The share of the budget each unit of work gets, relative to the others.
WEIGHTS = {"gpt2": 1.0, "llama-1b": 2.0, "llama-1b-lora": 2.0, "bert": 1.0, "vit": 1.0, "batch-probe": 1.5,
           "checkpointing-memory": 1.0}  # fmt: skip
TIMING_SHARE = 0.4
PROBE_MODEL, PROBE_VARIANT = "llama-1b", "dp-auto"
#: Imported once by the server the memory processes fork from.
PRELOAD = (
    "torch", "opacus", "peft", "lightning_dp.engine.privacy_engine", "lightning_dp.hf.losses",
    *(f"transformers.models.{name}.modeling_{name}" for name in ("gpt2", "llama", "bert", "vit")),
)  # fmt: skip


def quiet() -> None:
    """Keep the per-variant noise out of the output: lightning_dp's start-up block (INFO, once per engine) and the
    libraries' repeated warnings (the bfloat16 rounding warning among them: the docs state it once)."""
    logging.getLogger("lightning_dp").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def make_step(variant: str, spec: ModelSpec, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> Step:
    """One full training step of ``variant`` on ``model`` (which it hooks or wraps) and ``batch``; it ends with the
    variant's ``zero_grad(set_to_none=True)``."""
    loss = loss_function(spec, batch)
    size = len(batch["labels"])
    if variant == "non-private":
        inner = plain_step(model, loss)
    elif variant.startswith("dp-"):
        inner = engine_step(model, loss, size, clipping=variant.removeprefix("dp-"))
    elif variant == "opacus-flat":
        inner = opacus_step(model, loss, size)
    elif variant == "opacus-ghost":
        inner = opacus_ghost_step(model, loss, size)
    else:
        raise ValueError(f"unknown variant {variant!r}: one of {VARIANTS}")
    optimizer = inner.optimizer  # type: ignore[attr-defined]

    def step() -> None:
        inner()
        optimizer.zero_grad(set_to_none=True)

    step.engine = getattr(inner, "engine", None)  # type: ignore[attr-defined]
    return step


def _build_alone(variant: str, args: argparse.Namespace) -> Step:
    """``variant``'s step on a model and batch of its own (the memory measurement's process): ``args.model`` at
    ``args.size``, ``args.batch_size`` examples (``None``: the spec's), without activation checkpointing unless
    ``args.checkpointing``."""
    quiet()
    device = torch.device(args.device)
    spec = model_spec(args.model, args.size)
    if not args.checkpointing:
        spec = dataclasses.replace(spec, checkpointing=False)
    return make_step(variant, spec, build_model(spec, device), make_batch(spec, device, args.batch_size))


def row_status(row: dict[str, Any]) -> str:
    """``ok``, ``out of memory``, ``skipped``, ``refused`` (the build raised) or ``failed`` (a step raised)."""
    if "error" not in row:
        return "ok"
    error = row["error"]
    if "OutOfMemoryError" in error or "out of memory" in error.lower():
        return "out of memory"
    if error.startswith("skipped"):
        return "skipped"
    return "refused" if row.get("failed_at") == "build" else "failed"


def _memory_args(
    args: argparse.Namespace, model: str, batch_size: int | None, checkpointing: bool = True
) -> argparse.Namespace:
    return argparse.Namespace(device=args.device, threads=args.threads, size=args.size, model=model,
                              batch_size=batch_size, checkpointing=checkpointing)  # fmt: skip


def time_model(spec: ModelSpec, args: argparse.Namespace, deadline: float) -> tuple[dict[str, dict], dict[str, str]]:
    """The timing rows of ``args.variants`` on ``spec``'s model, interleaved in this process until ``deadline``
    (:func:`timing.time_interleaved`), and the engine each ``dp-*`` variant ran; the models are dropped on return."""
    device = torch.device(args.device)
    base = build_model(spec, device)
    batch = make_batch(spec, device)
    engines: dict[str, str] = {}

    def build(variant: str) -> Step:
        step = make_step(variant, spec, copy.deepcopy(base), batch)
        if step.engine is not None:  # type: ignore[attr-defined]
            engines[variant] = step.engine.clipping  # type: ignore[attr-defined]
        return step

    timing_args = argparse.Namespace(
        variants=list(args.variants), device=args.device, warmup=args.warmup, steps=args.steps,
        max_step_seconds=args.max_step_seconds, deadline=deadline,
    )  # fmt: skip
    return time_interleaved(timing_args, build), engines


PROFILED = ("non-private", "dp-auto")
#: The packages whose versions the record states (and the run prints first).
PACKAGES = ("transformers", "peft", "accelerate", "opacus", "dp-accounting")


def package_version(name: str) -> str | None:
    """The installed version of ``name``; ``None`` when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def profile_model(spec: ModelSpec, args: argparse.Namespace) -> dict[str, Any]:
    """The operators (kernels, on CUDA) the ``dp-auto`` step spends the most time on beyond the ``non-private`` step
    (bench/step_profile.py): each variant on its own copy of the model, one step left out, then ``args.profile``
    steps under the torch profiler; the models are dropped on return."""
    device = torch.device(args.device)
    base, batch = build_model(spec, device), make_batch(spec, device)
    rows = {}
    for variant in PROFILED:
        step, profiler = make_step(variant, spec, copy.deepcopy(base), batch), StepProfiler(device, skip=1)
        for _ in range(1 + args.profile):
            profiler.begin()
            step()
            profiler.end()
        rows[variant] = profiler.rows()
        del step
        release(device)
    return extra_operators(rows["dp-auto"], rows["non-private"], device=device.type == "cuda")


def run_model(name: str, args: argparse.Namespace, timing_deadline: float, deadline: float) -> dict[str, Any]:
    """Time ``args.variants`` on model ``name`` interleaved (until ``timing_deadline``), then measure each one's
    memory in its own process (none once ``deadline`` passed) and, with ``args.profile`` and both of
    :data:`PROFILED` timed, profile their steps (:func:`profile_model`); the rows with their status and ratios."""
    spec = model_spec(name, args.size)
    results, engines = time_model(spec, args, timing_deadline)
    release(torch.device(args.device))
    for variant in args.variants:
        row = results.setdefault(variant, {"error": "no result"})
        if args.no_memory or "error" in row:
            continue
        left = deadline - time.perf_counter()
        if left <= 0:
            row["memory_error"] = "skipped: time budget"
            continue
        memory = measure_memory(
            _build_alone, variant, _memory_args(args, name, None), timeout=max(left, 30.0), preload=PRELOAD
        )
        if "error" in memory:
            row["memory_error"] = memory["error"]
        else:
            row.update(memory)
    for row in results.values():
        row["status"] = row_status(row)
        row.update(ratios(row, results["non-private"], args.device, "vs_non_private"))
        for opacus in OPACUS:
            if opacus in results:
                row.update(ratios(row, results[opacus], args.device, f"vs_{opacus.replace('-', '_')}"))
    out = {"spec": spec.describe(), "engines": engines, "results": {v: results[v] for v in args.variants}}
    timed = all(results.get(variant, {}).get("status") == "ok" for variant in PROFILED)
    if args.profile and timed and time.perf_counter() < deadline:
        try:
            out["profile"] = profile_model(spec, args)
        except Exception as err:  # noqa: BLE001 (a failed profile keeps the model's measured rows)
            out["profile"] = {"error": f"{type(err).__name__}: {err}"}
        release(torch.device(args.device))
    return out


def probe_batch(args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """The largest physical batch of ``llama-1b`` under ``dp-auto`` that fits: from the timed batch, doubling, each
    size in its own process (two steps), until one fails (out of memory), ``deadline`` or ``args.probe_max_batch``."""
    batch_size, probes, stopped = model_spec(PROBE_MODEL, args.size).batch_size, [], ""
    while not stopped:
        left = deadline - time.perf_counter()
        if batch_size > args.probe_max_batch:
            stopped = f"reached --probe-max-batch {args.probe_max_batch}"
        elif left <= 0:
            stopped = "time budget"
        else:
            memory_args = _memory_args(args, PROBE_MODEL, batch_size)
            result = measure_memory(_build_alone, PROBE_VARIANT, memory_args, timeout=max(left, 30.0), preload=PRELOAD)
            probes.append({"batch_size": batch_size, "status": row_status(result), **result})
            if "error" in result:
                stopped = f"{row_status(result)} at {batch_size}"
            batch_size *= 2
    fits = [probe["batch_size"] for probe in probes if probe["status"] == "ok"]
    return {"model": PROBE_MODEL, "variant": PROBE_VARIANT, "probes": probes, "largest_fits": max(fits, default=None),
            "stopped": stopped}  # fmt: skip


def checkpointing_memory(args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """The peak memory of ``llama-1b`` without activation checkpointing, ``non-private`` and ``dp-auto``, each in its
    own process (none once ``deadline`` passed): beside the model's rows with it, what checkpointing saves."""
    rows: dict[str, dict[str, Any]] = {}
    for variant in ("non-private", PROBE_VARIANT):
        left = deadline - time.perf_counter()
        if left <= 0:
            rows[variant] = {"status": "skipped", "error": "skipped: time budget"}
            continue
        memory_args = _memory_args(args, PROBE_MODEL, None, checkpointing=False)
        result = measure_memory(_build_alone, variant, memory_args, timeout=max(left, 30.0), preload=PRELOAD)
        rows[variant] = {"status": row_status(result), **result}
    return {"model": PROBE_MODEL, "results": rows}


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every model of ``args.models`` (:func:`run_model`), then the batch probe (:func:`probe_batch`, unless
    ``args.no_probe`` or without ``llama-1b``) and :func:`checkpointing_memory` (unless ``args.no_memory`` or without
    ``llama-1b``), each with its share of ``args.budget``; after each unit the record so
    far is written to ``args.out`` (when given), so that an interrupted run keeps what it measured."""
    start = time.perf_counter()
    end = start + args.budget
    units = list(args.models)
    if not args.no_probe and PROBE_MODEL in args.models:
        units.append("batch-probe")
    if not args.no_memory and PROBE_MODEL in args.models:
        units.append("checkpointing-memory")
    out: dict[str, Any] = {"order": list(args.variants), "models": {}}
    if not args.no_memory or "batch-probe" in units:
        start_forkserver(PRELOAD)
    for index, unit in enumerate(units):
        now = time.perf_counter()
        share = max(end - now, 0.0) * WEIGHTS[unit] / sum(WEIGHTS[u] for u in units[index:])
        try:
            if unit == "batch-probe":
                result = probe_batch(args, now + share)
            elif unit == "checkpointing-memory":
                result = checkpointing_memory(args, now + share)
            else:
                result = run_model(unit, args, now + TIMING_SHARE * share, now + share)
        except Exception as error:  # noqa: BLE001 (one unit's failure, an out-of-memory build, keeps the others)
            result = {"error": short_error(error)}
        release(torch.device(args.device))
        if unit in MODELS:
            out["models"][unit] = result
        else:
            out[unit.replace("-", "_")] = result
        out["elapsed_seconds"] = time.perf_counter() - start
        print(f"[{out['elapsed_seconds']:.0f} s] {unit}: {result.get('error', 'done')}", flush=True)
        if args.out:
            write(args, out)
    return out


def record_of(args: argparse.Namespace, out: dict[str, Any]) -> dict[str, Any]:
    """The JSON record: the command that reproduces the run, the arguments, the environment and the results."""
    env = environment(args.device)
    env["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    for name in PACKAGES:
        env[name] = package_version(name)
    env["load_before"], env["load_after"] = args.load_before, os.getloadavg()[0]
    arguments = {key: value for key, value in vars(args).items() if key not in ("load_before", "out")}
    return {
        "command": shlex.join(["python", "bench/gpu.py", *reproducing_argv(sys.argv[1:], drop=("--render",))]),
        "args": arguments,
        "environment": env,
        **out,
    }


def write(args: argparse.Namespace, out: dict[str, Any]) -> Path:
    """Write the record to ``args.out``; re-render the docs when it lies in docs/bench/gpu/."""
    path = Path(args.out).resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record_of(args, out), indent=1), encoding="utf-8")
    if path.parent == RECORDS.resolve():
        render()
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--toy`` sets ``--size toy``; ``--out`` defaults to docs/bench/gpu/real.json at the real
    size and to none (print only) for the toy."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--size", choices=SIZES, default="real")
    parser.add_argument("--toy", action="store_true", help="tiny configs, the same code paths (--size toy)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=5, help="timed rounds at most (fewer when the budget is short)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for the measurements (default 420)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU (default 1)")
    parser.add_argument("--max-step-seconds", type=float, default=60.0)
    parser.add_argument("--no-memory", action="store_true", help="skip the per-process memory measurement")
    parser.add_argument("--no-probe", action="store_true", help="skip the largest-batch probe")
    parser.add_argument("--profile", type=int, default=2, metavar="N",
                        help="profiled steps of non-private and dp-auto per model, within its time share "
                        "(default 2; 0: no profile)")  # fmt: skip
    parser.add_argument("--probe-max-batch", type=int, help="largest batch the probe tries (default 512; toy 8)")
    parser.add_argument("--out", help="the JSON record's path (default docs/bench/gpu/real.json; toy: none)")
    parser.add_argument("--json", action="store_true", help="print the record as JSON instead of the report")
    parser.add_argument("--render", action="store_true", help="only re-render the docs from docs/bench/gpu/*.json")
    args = parser.parse_args(argv)
    if args.toy:
        args.size = "toy"
    if args.probe_max_batch is None:
        args.probe_max_batch = 8 if args.size == "toy" else 512
    if args.out is None and args.size == "real":
        args.out = str(RECORDS / "real.json")
    if "non-private" not in args.variants:
        args.variants.insert(0, "non-private")
    return args


def main(argv: list[str] | None = None) -> None:
    """Parse, run (or only re-render), write the record, print the report."""
    args = parse_args(argv)
    if args.render:
        render()
        return
    quiet()
    torch.set_num_threads(args.threads)
    args.load_before = os.getloadavg()[0]
    versions = ", ".join(f"{name} {package_version(name)}" for name in PACKAGES)
    print(f"{environment(args.device)['device_name']}: torch {torch.__version__}, {versions}", flush=True)
    out = run(args)
    if args.out:
        write(args, out)
    record = record_of(args, out)
    print(json.dumps(record) if args.json else "\n".join(report_lines(record)))


if __name__ == "__main__":
    main()
