"""Step time and per-rank memory of DP training on an FSDP2-sharded model, against non-private FSDP2 and Opacus.

Model (built from a config, no download, float32): a tiny Llama, hidden 256, 4 decoder layers, 4 heads, MLP 688,
a 32000-token vocabulary with an UNTIED output head (the embedding and the head are 8.2 M parameters each, 84 % of
the model). ``--world-size`` processes (default 2; gloo on CPU, nccl on CUDA), ``init_device_mesh(device, (W,))``.
Each rank trains on one fixed batch of ``--batch-size`` B sequences of ``--seq-len`` T random tokens (its own), per-
sample mean token cross-entropy (``lightning_dp.hf.losses.token_cross_entropy``), AdamW (lr 1e-4).

Variants, each on its own copy of the model (identical weights), sharded in the same processes:
- ``fsdp-plain``: ``fully_shard`` on each decoder layer and on the root; the mean of the per-sample losses,
  ``loss.backward()``, ``AdamW.step()`` (FSDP2 averages the gradients over the ranks in its reduce-scatters);
- ``ours-<engine>`` for the exact engines with book-keeping (``flat, ghost, fgc, mixed``): the same sharding, then
  lightning_dp's run sequence as its trainer adapters drive it (``PrivacyEngine(noise_multiplier=1.0,
  max_grad_norm=1.0, clipping=<engine>, check_batch_independence=False).start_run(model, distributed_context())``,
  ``training_loader``, ``start_training``; per step ``per_sample_loss``, ``clip``, ``DPOptimizer.step``);
- ``opacus-fsdp-ghost``: Opacus's FSDP2 ghost clipping as its own FSDP test uses it: ``FSDP2Wrapper(model)`` (which
  shards every layer Opacus has a sampler for: each Linear and Embedding; and the root),
  ``GradSampleModuleFastGradientClippingFSDP``, ``FSDPOptimizerFastGradientClipping`` around AdamW and
  ``DPLossFastGradientClipping`` (two backward passes per step); noise_multiplier 1.0, max_grad_norm 1.0. When it
  refuses the model, its error is its row.

Time: all variants live in the same processes and run interleaved: each round runs ``--steps-per-round`` steps of
every variant in turn, the order rotating every round, so that load changes on a shared machine hit all variants
alike. The first step of each variant is left out (set-up, the optimizer state's allocation). The ranks start each
step together (a barrier). On CPU a step is the CPU time of the rank's process (``time.process_time``, one intra-op
thread: ``--threads``); on CUDA the wall time between synchronisations. Reported: the median over the kept steps on
each rank, its mean over the ranks, and its ratio to ``fsdp-plain``.

Memory, per rank (the largest over the ranks):
- ``state``: the bytes of the local tensors of the parameters, the gradients and the optimizer state (the local
  shards, ``DTensor.to_local()``; Opacus's optimizer keeps a copy of the summed gradient, counted as its state),
  after the last timed step;
- ``peak``: each variant runs alone in a fresh set of processes (spawned per variant) for ``--memory-steps`` steps:
  on CPU the peak resident set (VmHWM, reset when the set-up is done; every process imports the same libraries,
  Opacus included, before it; glibc's mmap threshold fixed at 64 KiB, so that a freed tensor leaves the resident set
  at once and the peak is that of the live tensors, not of the allocator's cache), on CUDA
  ``torch.cuda.max_memory_allocated``;
- ``peak extra``: that peak minus the memory when the set-up was done (the libraries, the sharded parameters): what
  the training steps add, i.e. gradients, optimizer state, activations, the gathered weights, the clipping.

``--record NAME`` writes the run to docs/bench/sharded/NAME.json and re-renders the "Sharded training (FSDP2)"
section of docs/performance.md from all records there; ``--render`` only re-renders.

Usage: ``python bench/sharded.py [--seq-len 128 --batch-size 4 --rounds 3 --steps-per-round 2] [--variants ...]``,
``python bench/sharded.py --device cuda`` (one GPU per rank)
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from records import add_record_options, environment, finish, plural, render_records

from lightning_dp.utils.help_format import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "bench" / "sharded"
PAGE = ROOT / "docs" / "performance.md"
START, END = "<!-- sharded:start -->", "<!-- sharded:end -->"

ENGINES = ("flat", "ghost", "fgc", "mixed")
PLAIN = "fsdp-plain"
VARIANTS = (PLAIN, *(f"ours-{engine}" for engine in ENGINES), "opacus-fsdp-ghost")
VOCAB = 32000
#: what each ratio to fsdp-plain divides ("seconds": the CPU time on CPU, the wall time on CUDA)
RATIOS = {
    "seconds": "time_ratio",
    "state_bytes": "state_ratio",
    "peak_extra_bytes": "peak_extra_ratio",
    "peak_bytes": "peak_ratio",
}


# ----------------------------------------------------------------------------------------------------- model
def build_model(seq_len: int, device: torch.device) -> torch.nn.Module:
    """The tiny Llama with an untied 32000-token head (seed 0: every call gives the same weights)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=seq_len, tie_word_embeddings=False,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(device).train()


def shard(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """``fully_shard`` on each decoder layer, then on the root (as tests/engine/test_fsdp.py)."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def rank_tokens(args: argparse.Namespace, rank: int, device: torch.device) -> torch.Tensor:
    """This rank's fixed batch: B sequences of T random tokens (different on every rank)."""
    generator = torch.Generator().manual_seed(1 + rank)
    return torch.randint(0, VOCAB, (args.batch_size, args.seq_len), generator=generator).to(device)


# ----------------------------------------------------------------------------------------------------- variants
class Variant:
    """One variant's training step on its own sharded model, and what its memory is made of."""

    def __init__(
        self, step: Callable[[], None], model: torch.nn.Module, optimizers: list[Any], extra_state: Callable[[], list]
    ) -> None:
        self.step, self.model, self.optimizers, self.extra_state = step, model, optimizers, extra_state

    def state_bytes(self) -> int:
        """Bytes of this rank's local tensors: parameters, gradients, optimizer state (each storage view once)."""
        from torch.distributed.tensor import DTensor

        tensors: list[torch.Tensor] = []
        for p in self.model.parameters():
            tensors.append(p)
            if p.grad is not None:
                tensors.append(p.grad)
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                tensors.extend(v for v in state.values() if isinstance(v, torch.Tensor))
        tensors.extend(self.extra_state())
        seen, total = set(), 0
        for tensor in tensors:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            key = (local.data_ptr(), local.numel(), local.dtype)
            if local.numel() and key not in seen:
                seen.add(key)
                total += local.numel() * local.element_size()
        return total


def make_variant(name: str, args: argparse.Namespace, mesh, tokens: torch.Tensor) -> Variant:
    from lightning_dp.hf.losses import token_cross_entropy

    model = build_model(args.seq_len, tokens.device)

    def per_sample_loss(ids: torch.Tensor) -> torch.Tensor:
        return token_cross_entropy(model(input_ids=ids).logits, ids, "mean", shift=True)

    if name == PLAIN:
        shard(model, mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def plain_step() -> None:
            optimizer.zero_grad(set_to_none=True)
            per_sample_loss(tokens).mean().backward()
            optimizer.step()

        return Variant(plain_step, model, [optimizer], list)
    if name.startswith("ours-"):
        return _ours(name.removeprefix("ours-"), args, model, mesh, tokens, per_sample_loss)
    if name == "opacus-fsdp-ghost":
        return _opacus(args, model, tokens)
    raise ValueError(f"unknown variant {name!r}")


def _ours(engine_name, args, model, mesh, tokens, per_sample_loss) -> Variant:
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dp import PrivacyEngine
    from lightning_dp.optim import distributed_context

    shard(model, mesh)
    context = distributed_context()
    engine = PrivacyEngine(
        max_grad_norm=1.0, noise_multiplier=1.0, clipping=engine_name, check_batch_independence=False, seed=0
    )
    engine.start_run(model, context)
    # N and q for the accountant only: the bench steps on its fixed batches, not on the Poisson loader
    examples = 64 * args.batch_size * args.world_size
    dataset = TensorDataset(torch.zeros(examples, args.seq_len, dtype=torch.long))
    engine.training_loader(DataLoader(dataset, batch_size=args.batch_size), batch_size=args.batch_size, micro_batches=1)
    (optimizer,) = engine.start_training([torch.optim.AdamW(model.parameters(), lr=1e-4)], total_steps=None)
    batch_size = len(tokens)

    def ours_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        engine.count_micro_batch()
        loss = engine.per_sample_loss(tokens, batch_size, per_sample_loss, module=model)
        engine.clip(loss)
        engine.end_logical_step(1)
        optimizer.step()

    return Variant(ours_step, model, [optimizer.original_optimizer], list)


def _opacus(args, model, tokens) -> Variant:
    from opacus.grad_sample import GradSampleModuleFastGradientClippingFSDP
    from opacus.optimizers import FSDPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping
    from opacus.utils.fsdp_utils import FSDP2Wrapper

    model = FSDP2Wrapper(model)  # Opacus's sharding: each layer it has a sampler for, and the root (default mesh)
    wrapped = GradSampleModuleFastGradientClippingFSDP(model, loss_reduction="mean", max_grad_norm=1.0)
    optimizer = FSDPOptimizerFastGradientClipping(
        torch.optim.AdamW(wrapped.parameters(), lr=1e-4), noise_multiplier=1.0, max_grad_norm=1.0,
        expected_batch_size=len(tokens), loss_reduction="mean",
    )  # fmt: skip
    criterion = DPLossFastGradientClipping(
        wrapped, optimizer, torch.nn.CrossEntropyLoss(reduction="mean"), loss_reduction="mean"
    )
    # Opacus needs position_ids expanded to the batch (as in bench/clipping_engines.py)
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand(len(tokens), -1)

    def opacus_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = wrapped(tokens, position_ids=positions).logits[:, :-1]
        loss = criterion(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), shape=logits.shape)
        loss.backward()
        optimizer.step()

    def summed_grads() -> list[torch.Tensor]:
        return [s["summed_grad"] for s in optimizer.grad_state.values() if s["summed_grad"] is not None]

    return Variant(opacus_step, model, [optimizer.original_optimizer], summed_grads)


# ----------------------------------------------------------------------------------------------------- workers
def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="utf-8") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:200]


def _quiet() -> None:
    for name in ("lightning_dp", "transformers", "opacus", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


class Ranks:
    """This process's rank in the group: device, mesh, synchronisation and the any-rank flag."""

    def __init__(self, rank: int, args: argparse.Namespace, port: int) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        self.dist, self.rank = dist, rank
        cuda = args.device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(rank)
        self.device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        dist.init_process_group(
            "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
            world_size=args.world_size, timeout=datetime.timedelta(seconds=args.collective_timeout),
        )  # fmt: skip
        self.mesh = init_device_mesh(self.device.type, (args.world_size,))

    def sync(self) -> None:
        """All ranks here, the device idle."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.dist.barrier()

    def any_rank(self, flag: bool) -> bool:
        tensor = torch.tensor([float(flag)], device=self.device)
        self.dist.all_reduce(tensor, op=self.dist.ReduceOp.MAX)
        return bool(tensor.item())


def _build(name: str, args: argparse.Namespace, ranks: Ranks, tokens: torch.Tensor) -> tuple[Variant | None, str]:
    """The variant, or its error; every rank agrees on whether it was built."""
    variant, error = None, ""
    try:
        variant = make_variant(name, args, ranks.mesh, tokens)
    except Exception as failure:  # noqa: BLE001 (a refusing baseline is reported, not fatal)
        error = _error(failure)
    if ranks.any_rank(variant is None):
        return None, error or "refused on another rank"
    return variant, ""


def _worker(rank: int, args: argparse.Namespace, port: int, mode: str, variants: list[str], out: str) -> None:
    torch.set_num_threads(args.threads)
    _quiet()
    result: dict[str, Any] = {}
    ranks = Ranks(rank, args, port)
    try:
        import transformers  # noqa: F401 (every process holds the same libraries before the memory baseline)

        import lightning_dp  # noqa: F401

        try:
            import opacus  # noqa: F401
        except ImportError:
            pass

        tokens = rank_tokens(args, rank, ranks.device)
        if mode == "memory":
            result = _memory(variants[0], args, ranks, tokens)
        else:
            result = _time(variants, args, ranks, tokens)
    except Exception:  # noqa: BLE001 (reported to the parent)
        result = {"crash": traceback.format_exc()}
    finally:
        Path(out, f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
        ranks.dist.destroy_process_group()


def _time(names: list[str], args: argparse.Namespace, ranks: Ranks, tokens: torch.Tensor) -> dict[str, Any]:
    """Every variant in these processes, interleaved; per step the CPU and wall seconds of this rank."""
    variants: dict[str, Variant] = {}
    rows: dict[str, dict[str, Any]] = {}
    for name in names:
        variant, error = _build(name, args, ranks, tokens)
        if variant is None:
            rows[name] = {"error": error}
        else:
            variants[name] = variant
    steps: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    cuda = ranks.device.type == "cuda"
    for round_ in range(args.rounds):
        order = list(variants)
        shift = round_ % max(len(order), 1)
        for name in order[shift:] + order[:shift]:
            if name not in variants:
                continue
            for _ in range(args.steps_per_round):
                ranks.sync()
                cpu, wall = time.process_time(), time.perf_counter()
                error = ""
                try:
                    variants[name].step()
                    if cuda:
                        torch.cuda.synchronize()
                except Exception as failure:  # noqa: BLE001
                    error = _error(failure)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                if ranks.any_rank(bool(error)):
                    rows[name] = {"error": error or "failed on another rank"}
                    del variants[name]
                    break
                steps[name].append({"cpu": cpu, "wall": wall})
    for name, variant in variants.items():
        kept = steps[name][args.skip_first :]
        if not kept:
            rows[name] = {"error": "no step kept (run more steps than --skip-first)"}
            continue
        rows[name] = {
            "steps": len(kept),
            "cpu_seconds": statistics.median(s["cpu"] for s in kept),
            "wall_seconds": statistics.median(s["wall"] for s in kept),
            "state_bytes": variant.state_bytes(),
        }
    return rows


def _memory(name: str, args: argparse.Namespace, ranks: Ranks, tokens: torch.Tensor) -> dict[str, Any]:
    """One variant alone: the peak memory of ``--memory-steps`` steps over the memory after the set-up."""
    variant, error = _build(name, args, ranks, tokens)
    if variant is None:
        return {"error": error}
    cuda = ranks.device.type == "cuda"
    ranks.sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    else:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # return what the set-up freed (the unsharded model) to the OS
        with open("/proc/self/clear_refs", "w", encoding="utf-8") as clear:
            clear.write("5")  # reset the peak resident set (VmHWM) to the current one
        start = _status_kib("VmRSS:") * 1024
    for _ in range(args.memory_steps):
        error = ""
        try:
            variant.step()
        except Exception as failure:  # noqa: BLE001
            error = _error(failure)
        if ranks.any_rank(bool(error)):
            return {"error": error or "failed on another rank"}
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = _status_kib("VmHWM:") * 1024
    return {"peak_extra_bytes": peak - start, "peak_bytes": peak, "setup_bytes": start}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: argparse.Namespace, mode: str, variants: list[str]) -> list[dict[str, Any]]:
    """Run ``mode`` on ``variants`` in ``--world-size`` fresh processes; each rank's result."""
    import multiprocessing as mp

    context = mp.get_context("spawn")
    port, began = _free_port(), time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench_sharded_") as out:
        processes = [
            context.Process(target=_worker, args=(rank, args, port, mode, variants, out))
            for rank in range(args.world_size)
        ]
        # memory on CPU: glibc serves every allocation of 64 KiB or more with its own mapping and unmaps it when it is
        # freed, so that the resident set follows the live tensors (its default threshold adapts and keeps freed
        # blocks, which moved the peak by tens of MiB between identical runs)
        environ = {"MALLOC_MMAP_THRESHOLD_": "65536"} if mode == "memory" and args.device == "cpu" else {}
        saved = {key: os.environ.get(key) for key in environ}
        os.environ.update(environ)
        try:
            for process in processes:
                process.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        deadline = time.monotonic() + args.timeout
        for process in processes:
            process.join(max(deadline - time.monotonic(), 1.0))
        stuck = [process for process in processes if process.is_alive()]
        for process in stuck:
            process.kill()
            process.join()
        results = []
        for rank, process in enumerate(processes):
            path = Path(out, f"rank{rank}.json")
            if path.exists():
                results.append(json.loads(path.read_text(encoding="utf-8")))
            elif process in stuck:
                results.append({"crash": f"rank {rank} killed after --timeout {args.timeout} s"})
            else:
                results.append({"crash": f"rank {rank} exited with code {process.exitcode}"})
    print(f"[{mode} {' '.join(variants)}] {time.monotonic() - began:.0f} s", file=sys.stderr)
    for rank, result in enumerate(results):
        if "crash" in result:
            print(f"[{mode} {' '.join(variants)}] rank {rank}:\n{result['crash']}", file=sys.stderr)
    return results


# ----------------------------------------------------------------------------------------------------- running
def _first_error(per_rank: list[dict[str, Any]], name: str | None = None) -> str | None:
    for result in per_rank:
        if "crash" in result:
            return result["crash"].strip().splitlines()[-1][:200]
        row = result.get(name, {}) if name is not None else result
        if "error" in row:
            return row["error"]
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, dict[str, Any]] = {name: {} for name in args.variants}
    timed = list(args.variants)
    if not args.no_memory:  # first, so that a variant that fails alone is left out of the timed run
        for name in args.variants:
            per_rank = launch(args, "memory", [name])
            error = _first_error(per_rank)
            if error is not None:
                results[name] = {"error": error}
                timed.remove(name)
                continue
            results[name].update(
                peak_extra_bytes=max(r["peak_extra_bytes"] for r in per_rank),
                peak_bytes=max(r["peak_bytes"] for r in per_rank),
            )
    per_rank = launch(args, "time", timed) if timed else []
    for name in timed:
        error = _first_error(per_rank, name)
        if error is not None:
            results[name] = {"error": error}
            continue
        rows = [r[name] for r in per_rank]
        results[name].update(
            steps=rows[0]["steps"],
            cpu_seconds=statistics.fmean(row["cpu_seconds"] for row in rows),
            wall_seconds=statistics.fmean(row["wall_seconds"] for row in rows),
            cpu_seconds_per_rank=[row["cpu_seconds"] for row in rows],
            wall_seconds_per_rank=[row["wall_seconds"] for row in rows],
            state_bytes=max(row["state_bytes"] for row in rows),
        )
    timed_by = "cpu_seconds" if args.device == "cpu" else "wall_seconds"
    base = results.get(PLAIN, {})
    for row in results.values():
        for key, ratio in RATIOS.items():
            key = timed_by if key == "seconds" else key
            if key in row and key in base:
                row[ratio] = row[key] / max(base[key], 1e-12)
    return {"order": list(args.variants), "results": results}


# ----------------------------------------------------------------------------------------------------- reports
def _cell(row: dict[str, Any], key: str, scale: float, digits: str) -> str:
    return f"{row[key] * scale:{digits}}" if key in row else "-"


def report_lines(record: dict[str, Any]) -> list[str]:
    """The plain-text report of one run (``record``: the JSON this script writes)."""
    args = record["args"]
    timed_by = "cpu" if args["device"] == "cpu" else "wall"
    lines = [
        f"tiny Llama (d=256, 4 layers, 32000-token untied head) T={args['seq_len']} B={args['batch_size']} per rank "
        f"x {args['world_size']} ranks device={args['device']} threads={args['threads']} rounds={args['rounds']} x "
        f"{args['steps_per_round']} steps (first {args['skip_first']} left out); time ratio from {timed_by} time",
        f"{'variant':<18} {'steps':>5} {'cpu s':>7} {'wall s':>7} {'x plain':>7} {'state MiB':>9} {'x plain':>7} "
        f"{'peak+ MiB':>9} {'x plain':>7} {'peak MiB':>9} {'x plain':>7}",
    ]
    for name in record["order"]:
        row = record["results"][name]
        if "error" in row:
            lines.append(f"{name:<18} {row['error']}")
            continue
        lines.append(
            f"{name:<18} {row.get('steps', '-'):>5} {_cell(row, 'cpu_seconds', 1, '>7.3f')} "
            f"{_cell(row, 'wall_seconds', 1, '>7.3f')} {_cell(row, 'time_ratio', 1, '>7.2f')} "
            f"{_cell(row, 'state_bytes', 2**-20, '>9.1f')} {_cell(row, 'state_ratio', 1, '>7.2f')} "
            f"{_cell(row, 'peak_extra_bytes', 2**-20, '>9.1f')} {_cell(row, 'peak_extra_ratio', 1, '>7.2f')} "
            f"{_cell(row, 'peak_bytes', 2**-20, '>9.1f')} {_cell(row, 'peak_ratio', 1, '>7.2f')}"
        )
    return lines


def markdown(record: dict[str, Any]) -> str:
    """One recorded run as the docs show it: the set-up, the command and the table."""
    args, env = record["args"], record["environment"]
    timed_by = "cpu" if args["device"] == "cpu" else "wall"
    threads = f", {plural(args['threads'], 'intra-op thread')}" if timed_by == "cpu" else ""
    lines = [
        f"**T={args['seq_len']}, B={args['batch_size']} per rank x {args['world_size']} ranks** ({env['device_name']}, "
        f"torch {env['torch']}{threads}, load average {env['load_before']:.2f} before / {env['load_after']:.2f} "
        f"after; {args['rounds']} rounds x {args['steps_per_round']} steps, the first step of each variant left out; "
        f"time ratios of {timed_by} time)",
        "",
        "```bash",
        record["command"],
        "```",
        "",
        f"| variant | steps | {timed_by} s / step | x {PLAIN} | state MiB / rank | x {PLAIN} | peak extra MiB / rank "
        f"| x {PLAIN} | peak MiB / rank | x {PLAIN} |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in record["order"]:
        row = record["results"][name]
        if "error" in row:
            lines.append(f"| {name} | {row['error']} | | | | | | | | |")
            continue
        cells = [
            str(row.get("steps", "-")),
            _cell(row, f"{timed_by}_seconds", 1, ".4g"),
            _cell(row, "time_ratio", 1, ".2f"),
            _cell(row, "state_bytes", 2**-20, ".1f"),
            _cell(row, "state_ratio", 1, ".2f"),
            _cell(row, "peak_extra_bytes", 2**-20, ".1f"),
            _cell(row, "peak_extra_ratio", 1, ".2f"),
            _cell(row, "peak_bytes", 2**-20, ".1f"),
            _cell(row, "peak_ratio", 1, ".2f"),
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render() -> None:
    """Re-render docs/performance.md's sharded section from the JSON records in docs/bench/sharded/."""
    render_records(RECORDS, markdown, PAGE, START, END)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step (default 4)")
    parser.add_argument("--world-size", type=int, default=2, help="processes (default 2; on CUDA one GPU each)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps-per-round", type=int, default=2)
    parser.add_argument("--skip-first", type=int, default=1, help="steps of each variant left out at the start")
    parser.add_argument("--memory-steps", type=int, default=2, help="steps of the per-variant memory run")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process (default 1)")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-variant memory runs")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before a launch's processes are killed")
    parser.add_argument("--collective-timeout", type=float, default=300.0, help="seconds a collective may wait")
    add_record_options(parser, RECORDS.relative_to(ROOT))
    args = parser.parse_args()
    if args.render:
        render()
        return
    args.variants = [PLAIN] + [v for v in dict.fromkeys(args.variants) if v != PLAIN]
    env = environment(args.device)
    out = run(args)
    finish(args, out, env, script="bench/sharded.py", records=RECORDS, render=render, report_lines=report_lines)


if __name__ == "__main__":
    main()
