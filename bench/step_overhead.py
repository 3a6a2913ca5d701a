"""Step time and peak memory of DP training against non-private training and Opacus, in one run.

Model: a tiny GPT-2 built from ``GPT2Config`` (2 layers, d=256, 4 heads, GPT-2 vocabulary, tied lm_head/wte),
sequence length T=128, batch B=8, per-sample mean token cross-entropy, SGD. Variants:

- ``non-private``: ``loss.mean().backward()``, ``optimizer.step()``;
- ``ours-flat`` / ``ours-ghost``: :class:`PerSampleClipper` (two backward passes) + Gaussian noise via
  :class:`DPOptimizer`;
- ``opacus-flat``: Opacus ``GradSampleModule`` + Opacus ``DPOptimizer`` (materialised per-sample grads).

Each variant runs in a fresh subprocess so peak memory is its own: on CUDA
``torch.cuda.max_memory_allocated``, on CPU the peak resident set (VmHWM) minus the resident set after the model
is built.

Usage: ``python bench/step_overhead.py [--steps 5] [--device cpu|cuda] [--vocab 50257]``
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _run_variant(variant: str, args: argparse.Namespace, queue: mp.Queue) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    device = torch.device(args.device)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=256,
        n_head=4,
        n_positions=args.seq_len,
        vocab_size=args.vocab,
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(config).to(device)
    model.train()
    tokens = torch.randint(0, args.vocab, (args.batch_size, args.seq_len), device=device)

    def per_sample_loss(logits: torch.Tensor) -> torch.Tensor:
        logits = logits[:, :-1].reshape(-1, args.vocab)
        token_loss = torch.nn.functional.cross_entropy(logits, tokens[:, 1:].reshape(-1), reduction="none")
        return token_loss.view(args.batch_size, -1).mean(dim=1)

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    if variant == "non-private":

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            per_sample_loss(model(tokens).logits).mean().backward()
            optimizer.step()
    elif variant.startswith("ours"):
        from lightning_dp.clipping import PerSampleClipper
        from lightning_dp.mechanisms import make_mechanism
        from lightning_dp.optim import DPOptimizer, DPRandomness

        clipper = PerSampleClipper(model, clipping=variant.split("-")[1], max_grad_norm=1.0)
        dp_optimizer = DPOptimizer(
            optimizer,
            mechanism=make_mechanism("gaussian", noise_multiplier=1.0, max_grad_norm=1.0),
            expected_batch_size=args.batch_size,
            randomness=DPRandomness(0),
        )

        def step() -> None:
            dp_optimizer.zero_grad(set_to_none=True)
            clipper.backward(per_sample_loss(model(tokens).logits))
            dp_optimizer.step()
    else:
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer as OpacusDPOptimizer

        wrapped = GradSampleModule(model, loss_reduction="sum")
        positions = torch.arange(args.seq_len, device=device).expand(args.batch_size, -1)
        opacus_optimizer = OpacusDPOptimizer(
            optimizer,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            expected_batch_size=args.batch_size,
            loss_reduction="sum",
        )

        def step() -> None:
            opacus_optimizer.zero_grad(set_to_none=True)
            # Opacus needs position_ids expanded to the batch (broadcast [1, T] ids give batch-1 per-sample grads);
            # loss_reduction="sum" matches clipping the per-sample losses.
            per_sample_loss(wrapped(tokens, position_ids=positions).logits).sum().backward()
            opacus_optimizer.step()

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_kib("VmRSS:") * 1024
    times = []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else _rss_kib("VmHWM:") * 1024
    queue.put({"variant": variant, "seconds": statistics.median(times[args.warmup :]), "peak_bytes": peak - base})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    context = mp.get_context("spawn")
    results = []
    for variant in ("non-private", "ours-flat", "ours-ghost", "opacus-flat"):
        queue = context.Queue()
        process = context.Process(target=_run_variant, args=(variant, args, queue))
        process.start()
        process.join()
        if process.exitcode != 0:
            results.append({"variant": variant, "error": f"exit code {process.exitcode}"})
            continue
        results.append(queue.get())
    base = results[0]
    for row in results:
        if "error" not in row:
            row["time_ratio"] = row["seconds"] / base["seconds"]
            row["memory_ratio"] = row["peak_bytes"] / max(base["peak_bytes"], 1)
    if args.json:
        print(json.dumps(results))
        return
    print(f"tiny GPT-2 (2 layers, d=256, vocab {args.vocab}), T={args.seq_len}, B={args.batch_size}, {args.device}")
    print(f"{'variant':<12} {'step s':>8} {'x non-priv':>10} {'peak MiB':>9} {'x non-priv':>10}")
    for row in results:
        if "error" in row:
            print(f"{row['variant']:<12} {row['error']}")
            continue
        print(
            f"{row['variant']:<12} {row['seconds']:>8.3f} {row['time_ratio']:>10.2f} "
            f"{row['peak_bytes'] / 2**20:>9.1f} {row['memory_ratio']:>10.2f}"
        )


if __name__ == "__main__":
    main()
