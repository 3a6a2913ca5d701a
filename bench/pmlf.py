"""DPSGD, LP-DPSGD, per-sample momentum and DP-PMLF on real data: test accuracy, wall time and peak memory.

Methods (DP-PMLF, Xu et al. 2026, Algorithm 1), all with the same hyper-parameters except their own:

- ``dpsgd``: neither part;
- ``lp-dpsgd``: the low-pass filter only (``DPStrategy(lowpass=...)``, Zhang et al. 2024a);
- ``momentum``: per-sample momentum only (``DPStrategy(momentum_length=k, momentum_beta=beta)``);
- ``dp-pmlf``: both.

Tasks: ``digits`` (the demo CNN of :mod:`lightning_dp.tasks.digits` on scikit-learn's digits) and ``cifar10`` (a
small GroupNorm CNN on the 5k-image CIFAR-10 training subset, tested on the 10k test images; the npz files are read in
place from ``cifar10/`` of the data root ``--cifar-dir``, else ``LIGHTNING_DP_DATA``, as the recipes read them:
:mod:`lightning_dp.tasks.local_data`). Every (task, method) runs in its own process, which trains all epsilons and
seeds of that method, so its peak resident memory (``ru_maxrss``) is the method's own; wall time is the training
loop only (the first training batch to the end of ``fit``; noise calibration, identical for all methods, is
excluded). The noise is calibrated per run for ``target_epsilon`` over the planned steps (PLD accountant, delta
1e-5): the filter and the momentum are post-processing / sensitivity-preserving (docs/privacy.md), so every method
gets the same noise.

Plain SGD without optimizer momentum is the outer optimizer (Algorithm 1 line 12), so the filter's smoothing is not
confounded with heavy-ball momentum.

Usage::

    PYTHONPATH=. nice -n 15 python bench/pmlf.py          # the full grid: docs/pmlf.md, docs/pmlf.png, pmlf.json
    PYTHONPATH=. nice -n 15 python bench/pmlf.py --methods dpsgd lp-dpsgd --epsilons 3 --seeds 0 1 --out /tmp/pmlf

Cost: the defaults (digits 8 epochs, CIFAR-10 3 epochs of a 8-channel CNN, momentum length 3, flat clipping, two
worker processes of one torch thread each) are sized so that the full grid (2 tasks x 4 methods x 3 epsilons x 3
seeds) takes about 20 min on 2 cores: measured DPSGD costs were about 0.05 CPU s per digits step and 0.26 CPU s per
CIFAR-10 step (batch 256), and per-sample momentum of length k costs about k times a DPSGD step.

The momentum methods need ``DPStrategy(momentum_length=..., momentum_beta=...)``; a build without them stops with
a message before training.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import resource
import statistics
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.nn.functional as F
from records import mean_std
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy
from lightning_dp.lightning.dp_mixin import DPStrategyMixin
from lightning_dp.recipes.cifar_data import TEST_FILE, TRAIN_FILE, standardise
from lightning_dp.tasks.digits import DigitsCNN, DigitsDataModule
from lightning_dp.tasks.local_data import local_data_dir
from lightning_dp.utils.help_format import HelpFormatter

METHODS = ("dpsgd", "lp-dpsgd", "momentum", "dp-pmlf")
FILTERED = {"lp-dpsgd", "dp-pmlf"}
WITH_MOMENTUM = {"momentum", "dp-pmlf"}
TASKS = ("digits", "cifar10")


# ------------------------------------------------------------------------------------------------ CIFAR-10 task
class CifarGroupNormCNN(pl.LightningModule):
    """Three 3x3 conv blocks (conv, GroupNorm, tanh, 2x2 average pooling) and a linear classifier; input
    ``[B, 3, 32, 32]``, logits ``[B, 10]``; 6,362 parameters with ``channels=8``, 19,626 with 16. Per-sample loss."""

    def __init__(self, lr: float, channels: int = 16) -> None:
        super().__init__()
        self.lr = lr
        c = channels
        self.net = nn.Sequential(
            nn.Conv2d(3, c, 3, padding=1),
            nn.GroupNorm(4, c),
            nn.Tanh(),
            nn.AvgPool2d(2),
            nn.Conv2d(c, 2 * c, 3, padding=1),
            nn.GroupNorm(4, 2 * c),
            nn.Tanh(),
            nn.AvgPool2d(2),
            nn.Conv2d(2 * c, 2 * c, 3, padding=1),
            nn.GroupNorm(4, 2 * c),
            nn.Tanh(),
            nn.AvgPool2d(2),
            nn.Flatten(),
            nn.Linear(2 * c * 16, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y, reduction="none")

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def load_cifar(path: Path) -> TensorDataset:
    """An npz of the CIFAR-10 folder (``x`` uint8 ``[N, 32, 32, 3]``, ``y`` int64) as a dataset of standardised
    ``[N, 3, 32, 32]`` images (the CIFAR-10 recipe's :func:`~lightning_dp.recipes.cifar_data.standardise`)."""
    with np.load(path) as data:
        return TensorDataset(standardise(data["x"]), torch.from_numpy(data["y"]).long())


# ------------------------------------------------------------------------------------------------ one run
class TrainingTimer(pl.Callback):
    """Wall and CPU seconds (this process) from the first training batch to the end of ``fit``; excludes the noise
    calibration. CPU seconds are the fairer comparison on a machine shared with other jobs."""

    def __init__(self) -> None:
        self.start: tuple[float, float] | None = None
        self.seconds = self.cpu_seconds = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self.start is None:
            self.start = (time.perf_counter(), time.process_time())

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        wall, cpu = self.start or (time.perf_counter(), time.process_time())
        self.seconds, self.cpu_seconds = time.perf_counter() - wall, time.process_time() - cpu


def task_setup(task: str, args: argparse.Namespace) -> tuple[pl.LightningModule, DataLoader, DataLoader, dict]:
    """Model, training loader, test loader and the task's settings."""
    if task == "digits":
        data = DigitsDataModule(batch_size=args.digits_batch_size)
        data.setup()
        model = DigitsCNN(lr=args.digits_lr, momentum=0.0)
        settings = dict(epochs=args.digits_epochs, batch_size=args.digits_batch_size, lr=args.digits_lr)
        return model, data.train_dataloader(), data.test_dataloader(), settings
    folder = local_data_dir(args.cifar_dir, "cifar10", (TRAIN_FILE, TEST_FILE), flag="--cifar-dir DIR")
    train, test = load_cifar(folder / TRAIN_FILE), load_cifar(folder / TEST_FILE)
    model = CifarGroupNormCNN(lr=args.cifar_lr, channels=args.cifar_channels)
    settings = dict(
        epochs=args.cifar_epochs, batch_size=args.cifar_batch_size, lr=args.cifar_lr, channels=args.cifar_channels
    )
    train_loader = DataLoader(train, batch_size=args.cifar_batch_size, shuffle=True)
    return model, train_loader, DataLoader(test, batch_size=1000), settings


@torch.no_grad()
def accuracy(model: nn.Module, loader: DataLoader) -> float:
    model.eval()
    correct = total = 0
    for x, y in loader:
        correct += int((model(x).argmax(dim=1) == y).sum())
        total += len(y)
    return correct / total


def method_options(method: str, args: argparse.Namespace) -> dict[str, Any]:
    """The strategy arguments that make ``method`` (the only arguments that differ between methods)."""
    options: dict[str, Any] = {}
    if method in FILTERED:
        options["lowpass"] = args.lowpass
    if method in WITH_MOMENTUM:
        options.update(momentum_length=args.momentum_length, momentum_beta=args.momentum_beta)
    return options


def train_once(task: str, method: str, epsilon: float, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    pl.seed_everything(seed, verbose=False)
    model, train_loader, test_loader, settings = task_setup(task, args)
    strategy = DPStrategy(
        target_epsilon=epsilon,
        target_delta=args.delta,
        max_grad_norm=args.max_grad_norm,
        clipping=args.clipping,
        seed=seed,
        device="cpu",
        **method_options(method, args),
    )
    timer = TrainingTimer()
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=settings["epochs"],
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, train_dataloaders=train_loader)
    summary = strategy.privacy_engine.summary()
    return {
        "task": task,
        "method": method,
        "target_epsilon": epsilon,
        "seed": seed,
        "test_acc": accuracy(model, test_loader),
        "seconds": timer.seconds,
        "cpu_seconds": timer.cpu_seconds,
        "epsilon": summary["epsilon"],
        "noise_multiplier": summary.get("noise_multiplier"),
        "steps": summary["steps"],
        "sample_rate": summary["sample_rate"],
        "num_params": summary["num_params"],
        "settings": settings,
    }


def worker(task: str, method: str, args: argparse.Namespace) -> None:
    """Every epsilon and seed of one (task, method), one JSON line per run, then the process's peak memory."""
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_dp").setLevel(logging.WARNING)
    logging.getLogger("absl").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    for epsilon in args.epsilons:
        for seed in args.seeds:
            print(json.dumps(train_once(task, method, epsilon, seed, args)), flush=True)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(json.dumps({"task": task, "method": method, "peak_rss_mb": peak_mb}), flush=True)


# ------------------------------------------------------------------------------------------------ the grid
def aggregate(runs: list[dict], peaks: dict[tuple[str, str], float]) -> list[dict]:
    """Mean +- std accuracy per (task, method, epsilon); time and memory relative to DPSGD of the same task."""
    rows = []
    keys = dict.fromkeys((r["task"], r["method"], r["target_epsilon"]) for r in runs)
    for task, method, epsilon in keys:
        mine = [r for r in runs if (r["task"], r["method"], r["target_epsilon"]) == (task, method, epsilon)]
        base = [r for r in runs if (r["task"], r["method"], r["target_epsilon"]) == (task, "dpsgd", epsilon)]
        accs = [r["test_acc"] for r in mine]
        test_acc, test_acc_std = mean_std(accs)
        seconds = statistics.mean(r["seconds"] for r in mine)
        cpu = statistics.mean(r["cpu_seconds"] for r in mine)
        rows.append(
            {
                "task": task,
                "method": method,
                "target_epsilon": epsilon,
                "epsilon": mine[0]["epsilon"],
                "test_acc": test_acc,
                "test_acc_std": test_acc_std,
                "seeds": len(accs),
                "seconds": seconds,
                "cpu_seconds": cpu,
                "time_vs_dpsgd": seconds / statistics.mean(r["seconds"] for r in base) if base else None,
                "cpu_vs_dpsgd": cpu / statistics.mean(r["cpu_seconds"] for r in base) if base else None,
                "peak_rss_mb": peaks.get((task, method)),
                "memory_vs_dpsgd": (
                    peaks[(task, method)] / peaks[(task, "dpsgd")] if (task, "dpsgd") in peaks else None
                ),
                "noise_multiplier": mine[0]["noise_multiplier"],
                "steps": mine[0]["steps"],
                "sample_rate": mine[0]["sample_rate"],
                "num_params": mine[0]["num_params"],
                "settings": mine[0]["settings"],
            }
        )
    return rows


def settings_text(args: argparse.Namespace) -> str:
    parts = [
        f"methods {args.methods}, tasks {args.tasks}, epsilons {args.epsilons}, delta {args.delta}",
        f"seeds {args.seeds}, max_grad_norm {args.max_grad_norm}, clipping {args.clipping}",
        f"lowpass {args.lowpass!r}, momentum_length {args.momentum_length}, momentum_beta {args.momentum_beta}",
        f"digits: {args.digits_epochs} epochs, batch {args.digits_batch_size}, lr {args.digits_lr}",
        f"cifar10: {args.cifar_epochs} epochs, batch {args.cifar_batch_size}, lr {args.cifar_lr}",
        f"channels {args.cifar_channels}; torch threads {args.threads}, {args.jobs} worker processes at once",
    ]
    return "; ".join(parts)


def _ratio(value: float | None) -> str:
    return f"{value:.2f}" if value is not None else "n/a"


def write_table(rows: list[dict], args: argparse.Namespace, path: Path) -> None:
    missing = [m for m in METHODS if m not in args.methods]
    lines = [
        "# DP-PMLF, LP-DPSGD and per-sample momentum against DPSGD",
        "",
        f"Produced by `bench/pmlf.py`. Settings: {settings_text(args)}.",
        "",
        "Test accuracy is the mean +- std over seeds. Time is the training loop's wall time and CPU time (mean over "
        "runs; CPU time is the fairer comparison on a shared machine), memory the peak resident memory of the "
        "method's own process (all its runs; includes the Python, torch and Lightning baseline); ratios are relative "
        "to DPSGD on the same task and epsilon. Every method gets the same calibrated noise (same epsilon).",
        "",
    ]
    if missing:
        lines += [f"**Partial run: methods {missing} were not run.**", ""]
    for task in dict.fromkeys(r["task"] for r in rows):
        first = next(r for r in rows if r["task"] == task)
        lines += [
            f"## {task}",
            "",
            f"{first['num_params']} parameters, sample rate {first['sample_rate']:.4f}, {first['steps']} steps.",
            "",
            "| method | target eps | reported eps | sigma | test acc | wall s | wall / DPSGD | CPU s | CPU / DPSGD "
            "| peak MB | memory / DPSGD |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in (r for r in rows if r["task"] == task):
            peak = f"{r['peak_rss_mb']:.0f}" if r["peak_rss_mb"] is not None else "n/a"
            lines.append(
                f"| {r['method']} | {r['target_epsilon']:g} | {r['epsilon']:.3f} | {r['noise_multiplier']:.3f} | "
                f"{r['test_acc']:.4f} +- {r['test_acc_std']:.4f} | {r['seconds']:.1f} | {_ratio(r['time_vs_dpsgd'])} "
                f"| {r['cpu_seconds']:.1f} | {_ratio(r['cpu_vs_dpsgd'])} | {peak} | {_ratio(r['memory_vs_dpsgd'])} |"
            )
        lines.append("")
    path.write_text("\n".join(lines))


def write_figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(dict.fromkeys(r["task"] for r in rows))
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for method in dict.fromkeys(r["method"] for r in rows if r["task"] == task):
            mine = [r for r in rows if (r["task"], r["method"]) == (task, method)]
            ax.errorbar(
                [r["target_epsilon"] for r in mine],
                [r["test_acc"] for r in mine],
                yerr=[r["test_acc_std"] for r in mine],
                marker="o",
                capsize=3,
                label=method,
            )
        ax.set_xscale("log")
        ax.set_xlabel("epsilon (delta = 1e-5)")
        ax.set_ylabel("test accuracy")
        ax.set_title(task)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_worker(job: tuple[str, str], forwarded: list[str]) -> list[str]:
    """Run one (task, method) in its own process; its JSON lines."""
    child = subprocess.run(
        [sys.executable, __file__, *forwarded, "--worker", *job], check=True, capture_output=True, text=True
    )
    return child.stdout.splitlines()


def check_momentum_support(methods: list[str]) -> None:
    needed = [m for m in methods if m in WITH_MOMENTUM]
    if needed and "momentum_length" not in inspect.signature(DPStrategyMixin.__init__).parameters:
        sys.exit(
            f"methods {needed} need DPStrategy(momentum_length=..., momentum_beta=...), which this build does not "
            "have: merge the per-sample momentum branch, or run --methods dpsgd lp-dpsgd"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0, 8.0])
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--clipping", default="flat")
    parser.add_argument("--lowpass", default="first-order", help="preset name or JSON {'a': [...], 'b': [...]}")
    parser.add_argument("--momentum-length", type=int, default=3)
    parser.add_argument("--momentum-beta", type=float, default=0.9)
    parser.add_argument("--digits-epochs", type=int, default=8)
    parser.add_argument("--digits-batch-size", type=int, default=128)
    parser.add_argument("--digits-lr", type=float, default=2.0)
    parser.add_argument("--cifar-epochs", type=int, default=3)
    parser.add_argument("--cifar-batch-size", type=int, default=256)
    parser.add_argument("--cifar-lr", type=float, default=2.0)
    parser.add_argument("--cifar-channels", type=int, default=8)
    parser.add_argument(
        "--cifar-dir", type=Path, default=None, help="data root or cifar10 folder (default $LIGHTNING_DP_DATA)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker process")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes at once (one per core)")
    parser.add_argument("--out", type=Path, default=Path("docs"))
    parser.add_argument("--worker", nargs=2, metavar=("TASK", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if isinstance(args.lowpass, str) and args.lowpass.lstrip().startswith("{"):
        args.lowpass = json.loads(args.lowpass)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(*args.worker, args)
        return
    check_momentum_support(args.methods)
    print(f"settings: {settings_text(args)}", flush=True)
    forwarded = list(argv if argv is not None else sys.argv[1:])
    jobs = [(task, method) for task in args.tasks for method in args.methods]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        outputs = pool.map(lambda job: run_worker(job, forwarded), jobs)
        runs, peaks = [], {}
        for (task, method), lines in zip(jobs, outputs, strict=True):
            for record in map(json.loads, lines):
                if "peak_rss_mb" in record:
                    peaks[(task, method)] = record["peak_rss_mb"]
                    continue
                runs.append(record)
                print(
                    f"{task} {method} eps={record['target_epsilon']:g} seed={record['seed']}: acc "
                    f"{record['test_acc']:.4f}, {record['seconds']:.1f} s wall, {record['cpu_seconds']:.1f} s CPU",
                    flush=True,
                )
    rows = aggregate(runs, peaks)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pmlf.json").write_text(json.dumps(rows, indent=1))
    write_table(rows, args, args.out / "pmlf.md")
    write_figure(rows, args.out / "pmlf.png")
    print(f"wrote {args.out / 'pmlf.md'}, {args.out / 'pmlf.png'} and {args.out / 'pmlf.json'}")


if __name__ == "__main__":
    main()
