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
from pathlib import Path
from typing import Any

import torch
from records import add_record_options, environment, finish, plural, render_records
from timing import Step, clipper_step, opacus_step, plain_step, ratios, time_and_memory, timed_by

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


def make_step(variant: str, model: torch.nn.Module, tokens: torch.Tensor) -> Step:
    """One training step of ``variant`` on ``model`` (which it may hook or wrap)."""
    batch = tokens.shape[0]
    vocab = model.config.vocab_size
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand(batch, -1)

    def per_sample_loss(logits: torch.Tensor) -> torch.Tensor:
        token_loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, vocab), tokens[:, 1:].reshape(-1), reduction="none"
        )
        return token_loss.view(batch, -1).mean(dim=1)

    def loss_of(module: torch.nn.Module) -> torch.Tensor:
        return per_sample_loss(module(tokens).logits)

    if variant == "non-private":
        return plain_step(model, loss_of)
    if variant == "noise-only":
        from lightning_dp.mechanisms import make_mechanism
        from lightning_dp.optim import DPRandomness

        randomness = DPRandomness(0)
        mechanism = make_mechanism("gaussian", noise_multiplier=1.0, max_grad_norm=1.0)
        params = [p for p in model.parameters() if p.requires_grad]

        def step() -> None:
            for p in params:
                mechanism.sample(p, randomness.noise_generator(p.device))

        return step
    if variant == "opacus-flat":
        # Opacus needs position_ids expanded to the batch
        return opacus_step(
            model, lambda wrapped: per_sample_loss(wrapped(tokens, position_ids=positions).logits), batch
        )
    if variant == "opacus-ghost":
        return _opacus_ghost_step(model, tokens, positions, vocab)
    from lightning_dp.config import PrivacyConfig

    if variant == "default":  # DPStrategy(noise_multiplier=1.0)'s clipper: the engine "auto" picks for Gaussian noise
        config = PrivacyConfig(noise_multiplier=1.0)
        options = {"clipping": config.resolved_clipping()[0], "sum_check_every": config.sum_check_every}
    else:
        options = {"clipping": variant.removesuffix("-bk")}
    return clipper_step(model, loss_of, batch, **options)


def _opacus_ghost_step(model, tokens, positions, vocab) -> Step:
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    wrapped = GradSampleModuleFastGradientClipping(model, loss_reduction="mean", max_grad_norm=1.0)
    opacus_optimizer = DPOptimizerFastGradientClipping(
        torch.optim.SGD(model.parameters(), lr=1e-3), noise_multiplier=1.0, max_grad_norm=1.0,
        expected_batch_size=tokens.shape[0], loss_reduction="mean",
    )  # fmt: skip
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


def _build(variant: str, args: argparse.Namespace) -> Step:
    """``variant``'s step on a model and tokens of its own (the memory measurement's process)."""
    device = torch.device(args.device)
    model = build_model(args.model, args.seq_len, device)
    return make_step(variant, model, _tokens(args, model.config.vocab_size, device))


def report_lines(record: dict[str, Any]) -> list[str]:
    """The plain-text report of one run (``record``: the JSON this script writes)."""
    args = record["args"]
    timed = timed_by(args["device"])
    lines = [
        f"model={args['model']} T={args['seq_len']} B={args['batch_size']} device={args['device']} "
        f"threads={args['threads']} steps={args['steps']}; time ratio from {timed.replace('_', ' ')}",
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
    timed = timed_by(args["device"])
    threads = f", {plural(args['threads'], 'intra-op thread')}" if args["device"] == "cpu" else ""
    lines = [
        f"**{args['model']}, T={args['seq_len']}, B={args['batch_size']}** ({env['device_name']}, torch "
        f"{env['torch']}{threads}; median of {args['steps']} interleaved steps after {args['warmup']} left out; "
        f"time ratios of {'cpu' if timed == 'cpu_seconds' else 'wall'} time)",
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
    device = torch.device(args.device)
    base = build_model(args.model, args.seq_len, device)
    tokens = _tokens(args, base.config.vocab_size, device)
    results = time_and_memory(args, lambda variant: make_step(variant, copy.deepcopy(base), tokens), _build)
    for row in results.values():
        row.update(ratios(row, results["non-private"], args.device, "ratio"))
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
