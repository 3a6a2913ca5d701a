"""Step time and peak memory of every clipping engine against non-private training and Opacus, in one run.

Models (built from a config, no download):
- ``gpt2``: tiny GPT-2, 2 layers, d=256, 4 heads, the GPT-2 vocabulary (50257) with ``lm_head`` tied to ``wte``;
- ``big-head``: tiny Llama, 2 layers, d=256, a 128256-token vocabulary (Llama 3's) with an untied output head.
Per-sample mean token cross-entropy, SGD, Gaussian noise (sigma=1, C=1).

Variants: ``non-private``; ``noise-only`` (drawing the Gaussian noise for every parameter, fp32, the cost DP adds on top
of clipping); ``default`` (every clipping option at its ``PrivacyConfig`` default, as ``DPStrategy()`` runs it:
``clipping="auto"`` resolved for Gaussian noise, book-keeping and its sum check); ``<engine>-bk`` (book-keeping: one
backward, sum check every 100 batches) for ``flat, ghost, fgc, mixed, hutch, hutchpp``; ``opacus-flat``
(``GradSampleModule``) and ``opacus-ghost`` (``GradSampleModuleFastGradientClipping``; its error is printed when it
refuses the model).

Time: all variants live in ONE process (one model copy each, identical weights) and run interleaved step by step,
rotating the order every round, so that load changes on a shared machine hit all variants alike; the median over
``--steps`` rounds is reported. On CPU the ratios use the process's CPU time per step (``time.process_time``) with
``--threads`` intra-op threads (default 1): other jobs on a shared machine stretch the wall time of a step but
hardly its CPU time, so these ratios stay put under load; the wall time is printed beside it. On CUDA the ratios
use the wall time between synchronisations. A variant whose step exceeds ``--max-step-seconds`` is dropped after
that step.
Memory: each variant runs alone in a fresh process (spawn); on CUDA ``torch.cuda.max_memory_allocated`` minus the
memory after the model and data are built, on CPU the peak resident set (VmHWM) minus the resident set then.

Usage: ``python bench/clipping_engines.py --model gpt2 --seq-len 128 --batch-size 8 [--device cuda] [--json]``;
``--record NAME`` also writes the run to ``docs/bench/clipping_engines/NAME.json`` and re-renders the section of
docs/performance.md between the ``clipping_engines`` markers from all records; ``--render`` only re-renders.
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from records import add_record_options, environment, finish, plural, render_records

from lightning_dp.utils.help_format import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "bench" / "clipping_engines"
PAGE = ROOT / "docs" / "performance.md"
START, END = "<!-- clipping_engines:start -->", "<!-- clipping_engines:end -->"

ENGINES = ("flat", "ghost", "fgc", "mixed", "hutch", "hutchpp")
VARIANTS = (
    "non-private",
    "noise-only",
    "default",
    *(f"{engine}-bk" for engine in ENGINES),
    "opacus-flat",
    "opacus-ghost",
)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def build_model(name: str, seq_len: int, device: torch.device) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if name == "gpt2":
        config = transformers.GPT2Config(
            n_layer=2, n_embd=256, n_head=4, n_positions=seq_len, vocab_size=50257,
            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(config)
    elif name == "big-head":
        config = transformers.LlamaConfig(
            vocab_size=128256, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, max_position_embeddings=seq_len, tie_word_embeddings=False,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
    else:
        raise ValueError(f"unknown model {name!r}")
    return model.to(device).train()


def make_step(variant: str, model: torch.nn.Module, tokens: torch.Tensor) -> Callable[[], None]:
    """One training step of ``variant`` on ``model`` (which it may hook or wrap)."""
    from lightning_dp.mechanisms import make_mechanism
    from lightning_dp.optim import DPOptimizer, DPRandomness

    batch = tokens.shape[0]
    vocab = model.config.vocab_size
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand(batch, -1)

    def per_sample_loss(logits: torch.Tensor) -> torch.Tensor:
        token_loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1), reduction="none"
        )
        return token_loss.view(batch, -1).mean(dim=1)

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    randomness = DPRandomness(0)
    mechanism = make_mechanism("gaussian", noise_multiplier=1.0, max_grad_norm=1.0)

    if variant == "non-private":

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            per_sample_loss(model(tokens).logits).mean().backward()
            optimizer.step()

        return step
    if variant == "noise-only":
        params = [p for p in model.parameters() if p.requires_grad]

        def step() -> None:
            for p in params:
                mechanism.sample(p, randomness.noise_generator(p.device))

        return step
    if variant.startswith("opacus"):
        return _opacus_step(variant, model, optimizer, per_sample_loss, tokens, positions, vocab)
    from lightning_dp.clipping import PerSampleClipper
    from lightning_dp.config import PrivacyConfig

    if variant == "default":  # DPStrategy(noise_multiplier=1.0)'s clipper: the engine "auto" picks for Gaussian noise
        config = PrivacyConfig(noise_multiplier=1.0)
        options = {"clipping": config.resolved_clipping()[0], "sum_check_every": config.sum_check_every}
    else:
        options = {"clipping": variant.removesuffix("-bk")}
    clipper = PerSampleClipper(model, max_grad_norm=1.0, generator_for=randomness.projection_generator, **options)
    dp_optimizer = DPOptimizer(optimizer, mechanism=mechanism, expected_batch_size=batch, randomness=randomness)

    def step() -> None:
        dp_optimizer.zero_grad(set_to_none=True)
        clipper.backward(per_sample_loss(model(tokens).logits))
        dp_optimizer.step()

    return step


def _opacus_step(variant, model, optimizer, per_sample_loss, tokens, positions, vocab) -> Callable[[], None]:
    if variant == "opacus-flat":
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer as OpacusDPOptimizer

        wrapped = GradSampleModule(model, loss_reduction="sum")
        opacus_optimizer = OpacusDPOptimizer(
            optimizer, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=tokens.shape[0],
            loss_reduction="sum",
        )  # fmt: skip

        def step() -> None:
            opacus_optimizer.zero_grad(set_to_none=True)
            # Opacus needs position_ids expanded to the batch; loss_reduction="sum" matches per-sample losses.
            per_sample_loss(wrapped(tokens, position_ids=positions).logits).sum().backward()
            opacus_optimizer.step()

        return step
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    wrapped = GradSampleModuleFastGradientClipping(model, loss_reduction="mean", max_grad_norm=1.0)
    opacus_optimizer = DPOptimizerFastGradientClipping(
        optimizer, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=tokens.shape[0], loss_reduction="mean"
    )
    criterion = DPLossFastGradientClipping(
        wrapped, opacus_optimizer, torch.nn.CrossEntropyLoss(reduction="mean"), loss_reduction="mean"
    )

    def step() -> None:
        opacus_optimizer.zero_grad(set_to_none=True)
        logits = wrapped(tokens, position_ids=positions).logits[:, :-1]
        loss = criterion(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1), shape=logits.shape)
        loss.backward()
        opacus_optimizer.step()

    return step


def _tokens(args: argparse.Namespace, vocab: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=generator).to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_interleaved(args: argparse.Namespace) -> dict[str, dict]:
    """Median step seconds per variant, all variants in this process, interleaved step by step."""
    device = torch.device(args.device)
    base = build_model(args.model, args.seq_len, device)
    tokens = _tokens(args, base.config.vocab_size, device)
    steps, results = {}, {}
    for variant in args.variants:
        try:
            steps[variant] = make_step(variant, copy.deepcopy(base), tokens)
        except Exception as error:  # noqa: BLE001 (a refusing baseline is reported, not fatal)
            results[variant] = {"error": f"{type(error).__name__}: {error}".splitlines()[0][:160]}
    times: dict[str, list[float]] = {v: [] for v in steps}
    cpu_times: dict[str, list[float]] = {v: [] for v in steps}
    for round_ in range(args.warmup + args.steps):
        if not steps:
            break
        order = list(steps)
        order = order[round_ % len(order) :] + order[: round_ % len(order)]
        for variant in order:
            if variant not in steps:
                continue
            _sync(device)
            start, cpu_start = time.perf_counter(), time.process_time()
            try:
                steps[variant]()
            except Exception as error:  # noqa: BLE001
                results[variant] = {"error": f"{type(error).__name__}: {error}".splitlines()[0][:160]}
                del steps[variant]
                continue
            _sync(device)
            elapsed, cpu_elapsed = time.perf_counter() - start, time.process_time() - cpu_start
            if round_ >= args.warmup:
                times[variant].append(elapsed)
                cpu_times[variant].append(cpu_elapsed)
            cost = cpu_elapsed if device.type == "cpu" else elapsed
            if cost > args.max_step_seconds:
                results[variant] = {"error": f"skipped: {cost:.0f} s per step > --max-step-seconds"}
                del steps[variant]
    for variant, samples in times.items():
        if variant not in results and samples:
            results[variant] = {
                "seconds": statistics.median(samples),
                "cpu_seconds": statistics.median(cpu_times[variant]),
            }
    return results


def _memory_worker(variant: str, args: argparse.Namespace, queue: mp.Queue) -> None:
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = build_model(args.model, args.seq_len, device)
    tokens = _tokens(args, model.config.vocab_size, device)
    try:
        step = make_step(variant, model, tokens)
    except Exception as error:  # noqa: BLE001
        queue.put({"error": str(error)})
        return
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    else:
        start = _rss_kib("VmRSS:") * 1024
    for _ in range(2):
        step()
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _rss_kib("VmHWM:") * 1024
    queue.put({"peak_bytes": peak - start})


def measure_memory(variant: str, args: argparse.Namespace) -> dict:
    """Peak extra memory of ``variant`` over two steps, alone in a fresh process."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_memory_worker, args=(variant, args, queue))
    process.start()
    process.join()
    if process.exitcode != 0:
        return {"error": f"exit code {process.exitcode}"}
    return queue.get()


def _timed_by(device: str) -> str:
    """The time the ratios compare: the process's CPU time on CPU (robust to other jobs), wall time on CUDA."""
    return "cpu_seconds" if device == "cpu" else "seconds"


def report_lines(record: dict[str, Any]) -> list[str]:
    """The plain-text report of one run (``record``: the JSON this script writes)."""
    args = record["args"]
    timed_by = _timed_by(args["device"])
    lines = [
        f"model={args['model']} T={args['seq_len']} B={args['batch_size']} device={args['device']} "
        f"threads={args['threads']} steps={args['steps']}; time ratio from {timed_by.replace('_', ' ')}",
        f"{'variant':<14} {'wall s':>8} {'cpu s':>8} {'x non-priv':>10} {'peak MiB':>9} {'x non-priv':>10}",
    ]
    for variant in record["order"]:
        row = record["results"][variant]
        if "seconds" not in row:
            lines.append(f"{variant:<14} {row.get('error', '')}")
            continue
        memory = f"{row['peak_bytes'] / 2**20:>9.1f} {row['memory_ratio']:>10.2f}" if "memory_ratio" in row else "-"
        lines.append(
            f"{variant:<14} {row['seconds']:>8.3f} {row['cpu_seconds']:>8.3f} {row['time_ratio']:>10.2f} {memory}"
        )
    return lines


def markdown(record: dict[str, Any]) -> str:
    """One recorded run as the docs show it: the set-up, the command and the table of times and memory."""
    args, env = record["args"], record["environment"]
    timed_by = _timed_by(args["device"])
    threads = f", {plural(args['threads'], 'intra-op thread')}" if args["device"] == "cpu" else ""
    lines = [
        f"**{args['model']}, T={args['seq_len']}, B={args['batch_size']}** ({env['device_name']}, torch "
        f"{env['torch']}{threads}; median of {args['steps']} interleaved steps after {args['warmup']} left out; "
        f"time ratios of {'cpu' if timed_by == 'cpu_seconds' else 'wall'} time)",
        "",
        "```bash",
        record["command"],
        "```",
        "",
        "| variant | wall ms | cpu ms | x non-private | peak extra MiB | x non-private |",
        "|---|---|---|---|---|---|",
    ]
    for variant in record["order"]:
        row = record["results"][variant]
        if "seconds" not in row:
            lines.append(f"| {variant} | {row.get('error', '')} | | | | |")
            continue
        memory = f"{row['peak_bytes'] / 2**20:.1f} | {row['memory_ratio']:.2f}" if "memory_ratio" in row else "- | -"
        lines.append(
            f"| {variant} | {row['seconds'] * 1e3:.4g} | {row['cpu_seconds'] * 1e3:.4g} | {row['time_ratio']:.2f} "
            f"| {memory} |"
        )
    return "\n".join(lines)


def render() -> None:
    """Re-render docs/performance.md's recorded engine runs from the JSON records in docs/bench/clipping_engines/."""
    render_records(RECORDS, markdown, PAGE, START, END)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every variant interleaved, then (unless ``--no-memory``) each variant's memory in its own process."""
    results = time_interleaved(args)
    for variant in args.variants:
        row = results.setdefault(variant, {"error": "no result"})
        if not args.no_memory and "error" not in row:
            row.update(measure_memory(variant, args))
    base = results["non-private"]
    timed_by = _timed_by(args.device)
    for row in results.values():
        if "seconds" in row:
            row["time_ratio"] = row[timed_by] / base[timed_by]
        if "peak_bytes" in row and "peak_bytes" in base:
            row["memory_ratio"] = row["peak_bytes"] / max(base["peak_bytes"], 1)
    return {"order": list(args.variants), "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", choices=("gpt2", "big-head"), default="gpt2")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU (default 1)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--max-step-seconds", type=float, default=60.0)
    parser.add_argument("--no-memory", action="store_true", help="skip the per-process memory measurement")
    add_record_options(parser, RECORDS.relative_to(ROOT))
    args = parser.parse_args()
    if args.render:
        render()
        return
    if "non-private" not in args.variants:
        args.variants.insert(0, "non-private")
    torch.set_num_threads(args.threads)
    env = environment(args.device)
    out = run(args)
    finish(
        args, out, env, script="bench/clipping_engines.py", records=RECORDS, render=render, report_lines=report_lines
    )


if __name__ == "__main__":
    main()
