"""ATen operators and host reads per steady-state optimizer step: DP training against the non-private step of the same
trainer, on both adapters, here and (``--before-tree``) at an earlier commit of the library.

What is counted, per optimizer step after ``--warmup`` steps (the first steps' one-off checks are left out), averaged
over ``--steps`` steps, between the trainer's step-begin and step-end callbacks (forward, backward, clipping, noise,
optimizer update and the trainer's own loop):

- ``ops``: every ATen operator call the dispatcher sees (a ``TorchDispatchMode``: kernels, views and copies alike;
  autograd's backward included), the launches a GPU step would make: where the library gathers on the CPU the few
  rows a pass needs and a GPU passes over the whole factor (``lightning_dp.clipping.rows.GATHERING_DEVICES``), the
  GPU's path is taken (the few other CPU branches, unfused reductions and noise drawn in pieces, stay the CPU's);
- ``syncs``: the calls that read a tensor on the host or size an output from its values (``item``, ``tolist``,
  ``bool``/``float``/``int`` of a tensor, ``cpu``, ``numpy``, ``nonzero``, boolean-mask indexing, ...; a
  ``TorchFunctionMode`` asking bench/host_reads.py, which tests/engine/test_host_syncs.py shares), each a device sync
  on a GPU; ``library_syncs`` those whose caller is in ``lightning_dp/``. The CPU's gathers
  (``host_reads.CPU_ONLY``) are not made: the GPU's path is taken, and every read it makes is counted.

Models: ``lightning``, ``DPStrategy`` on an MLP (``--blocks`` blocks ``Linear(d, d) -> LayerNorm -> tanh``, ``d =
--dim``, then ``Linear(d, 1)``; squared error, SGD, batch ``--batch-size``); ``hf``, ``DPTrainer`` on a GPT-2 of
``--blocks`` layers (width 16, 2 heads, vocabulary 50, sequences of 8 tokens, AdamW, batch ``--batch-size``). Both DP
runs: Gaussian noise (sigma 1, C 1), the default engine (``mixed``), Poisson sampling at the batch size's rate, seed 0.
The non-private runs: Lightning's default strategy on the same module with a mean loss; transformers' ``Trainer``.
Op counts depend on the Poisson batch sizes only through the per-sample work, not in number.

Usage: ``python bench/op_count.py [--before-tree PATH] [--json]``; ``--before-tree PATH`` also runs this script with
``PATH`` (a ``git worktree`` of an earlier commit) first on ``PYTHONPATH`` and records its counts as ``before``;
``--record NAME`` writes ``docs/bench/op_count/NAME.json`` and re-renders the section of docs/performance.md between
the ``op_count`` markers; ``--render`` only re-renders.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import host_reads
import torch
from records import add_record_options, environment, finish, render_records, short_head
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_dp.utils.help_format import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "bench" / "op_count"
PAGE = ROOT / "docs" / "performance.md"
START, END = "<!-- op_count:start -->", "<!-- op_count:end -->"
ADAPTERS = ("lightning", "hf")


class Counter(TorchDispatchMode):
    """Counts ATen operator calls (all overloads of one operator together) while :attr:`active`."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.active:
            name = func.overloadpacket.__name__
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


class Reads(TorchFunctionMode):
    """Counts the host reads (:func:`host_reads.is_sync`; not :func:`host_reads.cpu_only`) while :attr:`active`, and
    those the library makes (:func:`host_reads.in_library`)."""

    def __init__(self) -> None:
        super().__init__()
        self.active = False
        self.total = 0
        self.library = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.active and host_reads.is_sync(getattr(func, "__name__", ""), args, kwargs):
            stack = traceback.extract_stack()[:-1]
            if not host_reads.cpu_only(stack):
                self.total += 1
                self.library += host_reads.in_library(stack)
        return func(*args, **kwargs)


class Window:
    """Turns the counters on for the optimizer steps from ``warmup`` on."""

    def __init__(self, counters: tuple[Counter, Reads], warmup: int) -> None:
        self.counters, self.warmup = counters, warmup

    def set(self, step: int) -> None:
        for counter in self.counters:
            counter.active = step >= self.warmup

    def clear(self) -> None:
        for counter in self.counters:
            counter.active = False


def _lightning(args: argparse.Namespace, private: bool, window: Window) -> None:
    import lightning.pytorch as pl
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dp import DPStrategy

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            layers: list[nn.Module] = []
            for _ in range(args.blocks):
                layers += [nn.Linear(args.dim, args.dim), nn.LayerNorm(args.dim), nn.Tanh()]
            self.net = nn.Sequential(*layers, nn.Linear(args.dim, 1))
            gen = torch.Generator().manual_seed(0)
            self.data = TensorDataset(torch.randn(256, args.dim, generator=gen), torch.randn(256, 1, generator=gen))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = ((self.net(x) - y) ** 2).squeeze(-1)
            return loss if private else loss.mean()

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.data, batch_size=args.batch_size)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Callback(pl.Callback):
        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            window.set(batch_idx)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            window.clear()

    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0) if private else "auto"
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", max_steps=args.warmup + args.steps, logger=False, callbacks=[Callback()],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(MLP())


def _hf(args: argparse.Namespace, private: bool, window: Window) -> None:
    import transformers
    from torch.utils.data import Dataset

    class Tokens(Dataset):
        def __init__(self) -> None:
            self.ids = torch.randint(1, 50, (256, 8), generator=torch.Generator().manual_seed(0))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class Callback(transformers.TrainerCallback):
        def on_step_begin(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
            window.set(state.global_step)

        def on_step_end(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
            window.clear()

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=args.blocks, n_embd=16, n_head=2, vocab_size=50, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as out:
        targs = transformers.TrainingArguments(
            output_dir=out, per_device_train_batch_size=args.batch_size, max_steps=args.warmup + args.steps,
            logging_steps=10_000, learning_rate=0.01, report_to="none", save_strategy="no", max_grad_norm=0.0,
            disable_tqdm=True, dataloader_pin_memory=False, use_cpu=True,
        )  # fmt: skip
        options: dict[str, Any] = dict(model=model, args=targs, train_dataset=Tokens(), callbacks=[Callback()])
        if private:
            from lightning_dp.hf import DPTrainer, PrivacyArguments

            privacy = PrivacyArguments(noise_multiplier=1.0, accountant="rdp", dp_seed=0)
            DPTrainer(privacy_args=privacy, **options).train()
        else:
            transformers.Trainer(**options).train()


@contextlib.contextmanager
def on_a_gpus_paths() -> Iterator[None]:
    """Make the library take, on the CPU, a GPU's pass over a whole factor where the CPU gathers the few rows it needs,
    until the block ends (``lightning_dp.clipping.rows.GATHERING_DEVICES`` emptied, then restored; a library from
    before that switch has no such paths)."""
    try:
        from lightning_dp.clipping import rows
    except ImportError:
        rows = None
    devices = getattr(rows, "GATHERING_DEVICES", None)
    if devices is not None:
        rows.GATHERING_DEVICES = frozenset()
    try:
        yield
    finally:
        if devices is not None:
            rows.GATHERING_DEVICES = devices


def count(args: argparse.Namespace, adapter: str, private: bool) -> dict[str, Any]:
    """Per-step ``ops`` (with the 12 most frequent operators), ``syncs`` and ``library_syncs`` of one run, on the paths
    a GPU takes (:func:`on_a_gpus_paths`)."""
    counters = (Counter(), Reads())
    window = Window(counters, args.warmup)
    with on_a_gpus_paths(), counters[0], counters[1]:
        (_lightning if adapter == "lightning" else _hf)(args, private, window)
    ops = counters[0].ops
    top = sorted(ops.items(), key=lambda item: -item[1])[:12]
    return {
        "ops": sum(ops.values()) / args.steps,
        "top_ops": {name: n / args.steps for name, n in top},
        "syncs": counters[1].total / args.steps,
        "library_syncs": counters[1].library / args.steps,
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every adapter, private and not: ``{adapter: {"dp": ..., "non_private": ...}}``."""
    return {
        adapter: {"dp": count(args, adapter, True), "non_private": count(args, adapter, False)} for adapter in ADAPTERS
    }


def _commit(tree: Path) -> str:
    return short_head(tree) or "unknown"


def before(args: argparse.Namespace) -> dict[str, Any]:
    """This script's counts with ``args.before_tree`` first on ``PYTHONPATH`` (an earlier commit of the library)."""
    tree = Path(args.before_tree).resolve()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    options = ["--dim", str(args.dim), "--blocks", str(args.blocks), "--batch-size", str(args.batch_size)]
    options += ["--warmup", str(args.warmup), "--steps", str(args.steps), "--counts-only"]
    done = subprocess.run(
        [sys.executable, "-W", "ignore", __file__, *options], env=env, capture_output=True, text=True, check=True
    )
    return {"commit": _commit(tree), "counts": json.loads(done.stdout.strip().splitlines()[-1])}


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"after": {"commit": _commit(ROOT), "counts": measure(args)}}
    if args.before_tree:
        out["before"] = before(args)
    return out


def markdown(record: dict[str, Any]) -> str:
    """One record as a heading line, the command and a table: per adapter, ops and host reads per step."""
    args, env = record["args"], record["environment"]
    after, earlier = record["after"], record.get("before")
    head = ["adapter", "non-private ops", "DP ops"]
    if earlier:
        head = ["adapter", "non-private ops", f"DP ops before ({earlier['commit']})"]
        head += [f"DP ops after ({after['commit']})"]
    head += ["DP / non-private", "non-private syncs", "DP syncs", "of which lightning_dp"]
    if earlier:
        head[-2:] = ["DP syncs before", "DP syncs after", "lightning_dp before", "lightning_dp after"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for adapter in ADAPTERS:
        now = after["counts"][adapter]
        dp, plain = now["dp"], now["non_private"]
        cells = [adapter, f"{plain['ops']:.0f}"]
        if earlier:
            old = earlier["counts"][adapter]["dp"]
            cells += [f"{old['ops']:.0f}", f"{dp['ops']:.0f}", f"{dp['ops'] / plain['ops']:.2f}x"]
            cells += [f"{plain['syncs']:g}", f"{old['syncs']:g}", f"{dp['syncs']:g}"]
            cells += [f"{old['library_syncs']:g}", f"{dp['library_syncs']:g}"]
        else:
            cells += [f"{dp['ops']:.0f}", f"{dp['ops'] / plain['ops']:.2f}x", f"{plain['syncs']:g}", f"{dp['syncs']:g}"]
            cells += [f"{dp['library_syncs']:g}"]
        rows.append("| " + " | ".join(cells) + " |")
    title = (
        f"**MLP d={args['dim']} x {args['blocks']} blocks (lightning), GPT-2 {args['blocks']} layers (hf), batch "
        f"{args['batch_size']}; per step, mean of {args['steps']} steps after {args['warmup']}** (torch "
        f"{env.get('torch', '?')}, CPU)"
    )
    return "\n".join([title, "", "```bash", record["command"], "```", "", *rows])


def render() -> None:
    render_records(RECORDS, markdown, PAGE, START, END)


def report_lines(record: dict[str, Any]) -> list[str]:
    return markdown(record).splitlines()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--dim", type=int, default=32, help="MLP width")
    parser.add_argument("--blocks", type=int, default=4, help="MLP blocks and GPT-2 layers")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="optimizer steps left out")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps counted")
    parser.add_argument("--before-tree", metavar="PATH", help="a worktree of an earlier commit: also count there")
    parser.add_argument("--counts-only", action="store_true", help=argparse.SUPPRESS)
    add_record_options(parser, RECORDS)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    if args.counts_only:
        print(json.dumps(measure(args)))
        return
    if args.render:
        render()
        return
    finish(
        args, run(args), environment("cpu"), script="bench/op_count.py", records=RECORDS, render=render,
        report_lines=report_lines,
    )  # fmt: skip


if __name__ == "__main__":
    main()
