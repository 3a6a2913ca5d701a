"""What the step benches share (bench/clipping_engines.py, bench/fallback_cost.py): the training step of each kind
(non-private, this library's clipper, Opacus's ``GradSampleModule``), timing the variants interleaved in one process,
and the peak memory of each variant alone in a fresh process."""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

#: ``module -> [B]`` per-sample losses of a forward through ``module`` (the model, or the Opacus wrapper around it).
PerSampleLoss = Callable[[torch.nn.Module], torch.Tensor]
#: One training step.
Step = Callable[[], None]


def short_error(error: BaseException) -> str:
    """``Type: first line of the message``, at most 160 characters: a refusing variant's row."""
    return f"{type(error).__name__}: {error}".splitlines()[0][:160]


def plain_step(model: torch.nn.Module, per_sample_loss: PerSampleLoss) -> Step:
    """A non-private SGD step on the mean loss. Each step helper here keeps its optimizer as the step's attribute
    ``optimizer``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        per_sample_loss(model).mean().backward()
        optimizer.step()

    step.optimizer = optimizer  # type: ignore[attr-defined]
    return step


def clipper_step(model: torch.nn.Module, per_sample_loss: PerSampleLoss, batch_size: int, **options: Any) -> Step:
    """A DP-SGD step through :class:`lightning_dp.clipping.PerSampleClipper` (``options``: its clipping options;
    C=1) and :class:`lightning_dp.optim.DPOptimizer` (SGD, Gaussian noise sigma=1)."""
    from lightning_dp.clipping import PerSampleClipper
    from lightning_dp.mechanisms import make_mechanism
    from lightning_dp.optim import DPOptimizer, DPRandomness

    randomness = DPRandomness(0)
    mechanism = make_mechanism("gaussian", noise_multiplier=1.0, max_grad_norm=1.0)
    clipper = PerSampleClipper(model, max_grad_norm=1.0, generator_for=randomness.projection_generator, **options)
    optimizer = DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-3), mechanism=mechanism, expected_batch_size=batch_size,
        randomness=randomness,
    )  # fmt: skip

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        clipper.backward(per_sample_loss(model))
        optimizer.step()

    step.optimizer = optimizer  # type: ignore[attr-defined]
    return step


def opacus_step(model: torch.nn.Module, per_sample_loss: PerSampleLoss, batch_size: int, **options: Any) -> Step:
    """A DP-SGD step through Opacus: ``GradSampleModule(model, **options)`` computes the per-sample gradients in the
    backward of the summed loss, its ``DPOptimizer`` clips them (C=1), adds Gaussian noise (sigma=1) and steps SGD."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer as OpacusDPOptimizer

    wrapped = GradSampleModule(model, loss_reduction="sum", **options)
    optimizer = OpacusDPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-3), noise_multiplier=1.0, max_grad_norm=1.0,
        expected_batch_size=batch_size, loss_reduction="sum",
    )  # fmt: skip

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        per_sample_loss(wrapped).sum().backward()  # loss_reduction="sum" matches per-sample losses
        optimizer.step()

    step.optimizer = optimizer  # type: ignore[attr-defined]
    return step


def opacus_ghost_step(model: torch.nn.Module, per_sample_loss: PerSampleLoss, batch_size: int) -> Step:
    """A DP-SGD step through Opacus's ghost clipping: ``GradSampleModuleFastGradientClipping(model)`` and its
    ``DPOptimizerFastGradientClipping`` (C=1, Gaussian noise sigma=1, SGD), the per-sample losses wrapped in
    ``DPTensorFastGradientClipping``, whose ``backward`` runs Opacus's two backward passes (norms, then the loss
    reweighted by the clip factors)."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping

    wrapped = GradSampleModuleFastGradientClipping(model, loss_reduction="mean", max_grad_norm=1.0)
    optimizer = DPOptimizerFastGradientClipping(
        torch.optim.SGD(model.parameters(), lr=1e-3), noise_multiplier=1.0, max_grad_norm=1.0,
        expected_batch_size=batch_size, loss_reduction="mean",
    )  # fmt: skip

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        DPTensorFastGradientClipping(wrapped, optimizer, per_sample_loss(wrapped), "mean").backward()
        optimizer.step()

    step.optimizer = optimizer  # type: ignore[attr-defined]
    return step


def engine_step(model: torch.nn.Module, per_sample_loss: PerSampleLoss, batch_size: int, **options: Any) -> Step:
    """A DP-SGD step as the trainer adapters drive lightning_dp's :class:`~lightning_dp.PrivacyEngine` (one process):
    ``PrivacyEngine(noise_multiplier=1.0, max_grad_norm=1.0, check_batch_independence=False, seed=0, **options)``
    (``options``: its clipping options, e.g. ``clipping="auto"``), ``start_run``, ``training_loader`` (on a stand-in
    dataset of 64 batches: N and q serve only the accountant, the step runs on the caller's batch),
    ``start_training`` around SGD; per step ``per_sample_loss``, ``clip``, ``end_logical_step`` and
    ``DPOptimizer.step``. The engine is the step's attribute ``engine``."""
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dp import PrivacyEngine

    engine = PrivacyEngine(
        max_grad_norm=1.0, noise_multiplier=1.0, check_batch_independence=False, seed=0, **options
    )  # fmt: skip
    engine.start_run(model, None)
    dataset = TensorDataset(torch.zeros(64 * batch_size))
    engine.training_loader(DataLoader(dataset, batch_size=batch_size), batch_size=batch_size, micro_batches=1)
    trainable = [p for p in model.parameters() if p.requires_grad]
    (optimizer,) = engine.start_training([torch.optim.SGD(trainable, lr=1e-3)], total_steps=None)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        engine.count_micro_batch()
        loss = engine.per_sample_loss(None, batch_size, lambda _: per_sample_loss(model), module=model)
        engine.clip(loss)
        engine.end_logical_step(1)
        optimizer.step()

    step.engine, step.optimizer = engine, optimizer  # type: ignore[attr-defined]
    return step


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Give the memory of dropped models back to the device: a collection (hooks hold reference cycles, which keep a
    dropped model alive until one) and, on CUDA, the allocator's cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed_by(device: str) -> str:
    """The time the ratios compare: the process's CPU time on CPU (robust to other jobs), wall time on CUDA."""
    return "cpu_seconds" if torch.device(device).type == "cpu" else "seconds"


def time_interleaved(args: argparse.Namespace, build: Callable[[str], Step]) -> dict[str, dict]:
    """Median step seconds (``seconds``, ``cpu_seconds``) of each of ``args.variants``, all built by ``build`` in this
    process and run interleaved step by step, the order rotated every round: ``args.warmup`` rounds left out, then
    ``args.steps`` (``timed_steps``: how many ran). A variant whose build or step raises, or whose step costs more
    than ``args.max_step_seconds``, gets an ``error`` instead (``failed_at``: ``build`` or ``step``). With
    ``args.deadline`` (a ``time.perf_counter()`` value; optional), no round starts that would end after it by the
    last round's time, once one round was timed."""
    device = torch.device(args.device)
    deadline = getattr(args, "deadline", None)
    steps, results = {}, {}
    for variant in args.variants:
        try:
            steps[variant] = build(variant)
        except Exception as error:  # noqa: BLE001 (a refusing baseline is reported, not fatal)
            results[variant] = {"error": short_error(error), "failed_at": "build"}
    times: dict[str, list[float]] = {v: [] for v in steps}
    cpu_times: dict[str, list[float]] = {v: [] for v in steps}
    round_seconds = 0.0
    for round_ in range(args.warmup + args.steps):
        if not steps:
            break
        if deadline is not None and round_ > args.warmup and time.perf_counter() + round_seconds > deadline:
            break
        round_start = time.perf_counter()
        order = list(steps)
        order = order[round_ % len(order) :] + order[: round_ % len(order)]
        for variant in order:
            if variant not in steps:
                continue
            sync(device)
            start, cpu_start = time.perf_counter(), time.process_time()
            try:
                steps[variant]()
            except Exception as error:  # noqa: BLE001
                results[variant] = {"error": short_error(error), "failed_at": "step"}
                del steps[variant]
                release(device)  # a failed variant's model must not crowd the others' steps
                continue
            sync(device)
            elapsed, cpu_elapsed = time.perf_counter() - start, time.process_time() - cpu_start
            if round_ >= args.warmup:
                times[variant].append(elapsed)
                cpu_times[variant].append(cpu_elapsed)
            cost = cpu_elapsed if device.type == "cpu" else elapsed
            if cost > args.max_step_seconds:
                results[variant] = {"error": f"skipped: {cost:.0f} s per step > --max-step-seconds"}
                del steps[variant]
                release(device)
        round_seconds = time.perf_counter() - round_start
    for variant, samples in times.items():
        if variant not in results and samples:
            results[variant] = {
                "seconds": statistics.median(samples),
                "cpu_seconds": statistics.median(cpu_times[variant]),
                "timed_steps": len(samples),
            }
    return results


def rss_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (``VmRSS:``, ``VmHWM:``); 0 where there is none."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _memory_worker(build: Callable[[str, argparse.Namespace], Step], variant: str, args: argparse.Namespace, queue):
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    try:
        step = build(variant, args)
    except Exception as error:  # noqa: BLE001
        queue.put({"error": short_error(error), "failed_at": "build"})
        return
    reset = _reset_peak(device)
    start = torch.cuda.memory_allocated(device) if device.type == "cuda" else rss_kib("VmRSS:") * 1024
    peaks = []
    try:
        for _ in range(2):
            step()
            sync(device)
            peaks.append(torch.cuda.max_memory_allocated(device) if device.type == "cuda" else rss_kib("VmHWM:") * 1024)
            reset = reset and _reset_peak(device)
    except Exception as error:  # noqa: BLE001 (out of memory, a refusal at the first step: reported)
        queue.put({"error": short_error(error), "failed_at": "step"})
        return
    peak = max(peaks)
    row = {"peak_bytes": peak - start, "peak_total_bytes": peak}
    if reset:  # the second step's own peak: without the first step's one-off work (the library's checks)
        row["steady_peak_bytes"] = peaks[1] - start
    queue.put(row)


def _reset_peak(device: torch.device) -> bool:
    """Start the peak over (CUDA: ``reset_peak_memory_stats``; CPU: the peak resident set, through
    /proc/self/clear_refs); False where it cannot."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return True


def start_forkserver(preload: tuple[str, ...]) -> None:
    """Start the ``forkserver`` that :func:`measure_memory` forks from (with ``preload``: the modules it imports once)
    now, so that its imports overlap with the caller's work."""
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload(list(preload))
    forkserver.ensure_running()


def measure_memory(
    build: Callable[[str, argparse.Namespace], Step],
    variant: str,
    args: argparse.Namespace,
    *,
    timeout: float | None = None,
    preload: tuple[str, ...] = (),
) -> dict:
    """Peak extra memory of ``variant`` over two steps, alone in a fresh process with ``args.threads`` threads:
    ``build(variant, args)`` builds the model, the data and the step there (a module-level function, so that
    it pickles); CUDA: ``max_memory_allocated`` minus the allocation then, CPU: the peak resident set (VmHWM) minus
    the resident set then (``peak_bytes``; ``peak_total_bytes``: the peak itself; ``steady_peak_bytes``: the second
    step's alone, where the peak can be started over). A build or step that raises (out of
    memory among them) gives its ``error``. The process is spawned, or with ``preload`` (module names) forked from a
    ``forkserver`` that imported them once (a fresh process too, without paying the imports each time); one still
    running after ``timeout`` seconds is killed."""
    context = mp.get_context("forkserver" if preload else "spawn")
    if preload:
        context.set_forkserver_preload(list(preload))
    queue = context.Queue()
    process = context.Process(target=_memory_worker, args=(build, variant, args, queue))
    process.start()
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
        return {"error": f"skipped: still running after {timeout:.0f} s"}
    if process.exitcode != 0:
        return {"error": f"exit code {process.exitcode}"}
    return queue.get()


def time_and_memory(
    args: argparse.Namespace, build: Callable[[str], Step], build_alone: Callable[[str, argparse.Namespace], Step]
) -> dict[str, dict]:
    """:func:`time_interleaved` with ``build``, then (unless ``args.no_memory``) :func:`measure_memory` of each variant
    that ran, with ``build_alone``; a variant with no result gets an ``error``."""
    results = time_interleaved(args, build)
    for variant in args.variants:
        row = results.setdefault(variant, {"error": "no result"})
        if not args.no_memory and "error" not in row:
            row.update(measure_memory(build_alone, variant, args))
    return results


def ratios(row: dict[str, Any], base: dict[str, Any], device: str, suffix: str) -> dict[str, float]:
    """``time_<suffix>`` (the :func:`timed_by` time) and ``memory_<suffix>`` (peak extra bytes) of ``row`` over
    ``base``, each where both rows have it."""
    timed, out = timed_by(device), {}
    if timed in row and timed in base:
        out[f"time_{suffix}"] = row[timed] / base[timed]
    if "peak_bytes" in row and "peak_bytes" in base:
        out[f"memory_{suffix}"] = row["peak_bytes"] / max(base["peak_bytes"], 1)
    return out
