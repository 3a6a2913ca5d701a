"""Cost of one batch-independence check: a DP-SGD step with the check (the gradient check and the leave-half-out
forwards, as on a step armed by ``check_batch_independence_every``) against the same step without it.

Models (no download):
- ``digits``: the demo's ``DigitsCNN`` (two 3x3 convolutions, GroupNorm, a linear head; ~10k parameters), float
  ``[B, 1, 8, 8]`` inputs (so the float-input leaf is checked too);
- ``gpt2``: GPT-2, 2 layers, d=256, 4 heads, the GPT-2 vocabulary (50257; ``lm_head`` tied to ``wte``), random token
  ids, per-example mean token cross-entropy (integer inputs: the hooked layer outputs are checked).

One model, one :class:`~lightning_dp.engine.privacy_engine.PrivacyEngine` (Gaussian noise, sigma=1, C=1, SGD): each
round takes one step without the check and one with it (the guard's two checks armed exactly as a due step arms them),
in alternating order, on the same fixed batch of ``B`` examples; the median CPU time (``time.process_time``, one
intra-op thread, so other jobs on a shared machine hardly move it) over ``--rounds`` rounds is reported, with the
wall time beside it.

Usage: ``python bench/independence_check.py --model digits --batch-size 128 [--clipping flat] [--rounds 20]``
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp import PrivacyEngine
from lightning_dp.checks.leave_half_out import LEAVE_HALF_OUT_FORWARDS
from lightning_dp.utils.help_format import HelpFormatter


def build(name: str, batch_size: int, seq_len: int) -> tuple[nn.Module, Any, Callable[[nn.Module, Any], torch.Tensor]]:
    """The model, a fixed batch of ``batch_size`` examples and ``loss(model, batch) -> [B]``."""
    torch.manual_seed(0)
    if name == "digits":
        from lightning_dp.tasks.digits import DigitsCNN

        model = DigitsCNN()
        batch = (torch.rand(batch_size, 1, 8, 8), torch.randint(0, 10, (batch_size,)))
        return model, batch, lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none")
    import transformers

    from lightning_dp.hf.losses import token_cross_entropy

    config = transformers.GPT2Config(
        n_layer=2, n_embd=256, n_head=4, n_positions=seq_len, vocab_size=50257,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len))
    batch = {"input_ids": ids, "labels": ids.clone()}
    return (
        model,
        batch,
        lambda m, b: token_cross_entropy(m(input_ids=b["input_ids"]).logits, b["labels"], "mean", shift=True),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=HelpFormatter)
    parser.add_argument("--model", choices=["digits", "gpt2"], default="digits")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--clipping", default="flat")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, batch, loss_of = build(args.model, args.batch_size, args.seq_len)
    model.train()
    engine = PrivacyEngine(max_grad_norm=1.0, noise_multiplier=1.0, clipping=args.clipping, seed=0)
    engine.attach(model)
    engine.prepare(num_samples=100 * args.batch_size, sample_rate=0.01, total_steps=None)
    optimizer = engine.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=1e-3))
    guard, size = engine.guard, args.batch_size

    def step(checked: bool) -> tuple[float, float]:
        guard.independence_pending = guard.leave_half_out_pending = checked
        cpu, wall = time.process_time(), time.perf_counter()
        optimizer.zero_grad()
        loss = loss_of(model, guard.before_forward(batch, size))
        guard.after_forward(loss)
        guard.leave_half_out(lambda b: loss_of(model, b), batch, size, model)
        engine.clipper.backward(loss)
        optimizer.step()
        return time.process_time() - cpu, time.perf_counter() - wall

    for checked in (False, True):  # warm-up
        step(checked)
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for round_ in range(args.rounds):
        for checked in (False, True) if round_ % 2 else (True, False):
            times[checked].append(step(checked))
    cpu = {k: statistics.median(t[0] for t in v) for k, v in times.items()}
    wall = {k: statistics.median(t[1] for t in v) for k, v in times.items()}
    passes = 2 * math.ceil(math.log2(size))
    print(
        f"{args.model} B={size} clipping={args.clipping} threads={args.threads}: step without check "
        f"{cpu[False] * 1e3:.1f} ms CPU ({wall[False] * 1e3:.1f} ms wall), with check {cpu[True] * 1e3:.1f} ms CPU "
        f"({wall[True] * 1e3:.1f} ms wall): a checked step costs {cpu[True] / cpu[False]:.2f}x "
        f"({passes} vector-Jacobian products + {LEAVE_HALF_OUT_FORWARDS} forwards)"
    )


if __name__ == "__main__":
    main()
