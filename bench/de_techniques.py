"""Two of De et al. 2022's techniques measured on the CIFAR-10 recipe's local data (docs/de_techniques.md):
augmentation multiplicity (Section 3.2) and parameter averaging (an exponential moving average of the weights).

    LIGHTNING_DP_DATA=ROOT python bench/de_techniques.py --seeds 0 1 2 --record cpu   # the runs, then render
    python bench/de_techniques.py --render           # only re-render from docs/bench/de_techniques/*.json
    LIGHTNING_DP_DATA=ROOT python bench/de_techniques.py --steps 2 --ks 1 2 --seeds 0 --eval-size 1000  # smoke run

One DP training per ``(K, seed)``, for ``K`` in ``--ks`` (1, 4, 8) and the seeds (0, 1, 2): the docs setup of
``configs/cifar10_offline.yaml`` (WRN-10-1 with GroupNorm, no weight standardisation: the model's default; the local
5,000-image training subset and the 10,000 test images; SGD lr 2 without momentum; clipping norm 1, ``flat``
engine; Gaussian noise calibrated for ``--target-epsilon`` 3 at delta 1e-5 with the PLD accountant) except the
expected batch, ``--batch-size`` 128 instead of 256 (the cost: ``K`` multiplies the rows through the network), for
``--steps`` 40. ``K`` copies of each sampled image, each randomly cropped (4-pixel reflect padding) and flipped, the
copies' gradients averaged before the example is clipped (the recipe's ``augmentation_multiplicity``, the same ``K``
for the model and the strategy); ``K = 1`` is the recipe without augmentation. ``K`` leaves the sensitivity and the
accounting unchanged, so every run has the same noise multiplier and epsilon.

Every run trains with Lightning's ``EMAWeightAveraging`` (``--ema-decay`` 0.9, averaging from step ``--ema-start``,
by default a quarter of the steps), and the same run is evaluated twice on the test images: with its last iterate
(the raw weights, kept just before the callback copies the average into the model) and with the average. The seed
sets ``seed_everything`` (initialisation, the crops and flips) and the DP strategy's ``seed`` (Poisson sampling,
noise); the data split stays the recipe's (``split_seed`` 0).

Recorded per run: ``K``, the seed, the test accuracy of the raw and of the averaged weights, the L2 distance between
the two, epsilon, the noise multiplier, the steps, the training seconds (first to last step) and the run's seconds
(set-up, calibration, training and both evaluations), each as wall-clock time and as the process's CPU time (all its
threads: on a shared machine the wall-clock time grows with the other jobs' load, the CPU time much less). Rendered:
one row per ``K`` (the accuracies' mean and sample standard deviation over the seeds, the averaged-minus-raw
difference paired by run, epsilon, the noise multiplier, the mean wall-clock seconds) between the
``<!-- de:start -->`` and ``<!-- de:end -->`` lines of docs/de_techniques.md, and docs/de_techniques.png (accuracy
against ``K``, raw and averaged, each seed's run and the means) from the last record.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path
from typing import Any

from records import add_record_options, render_records_and_figure, run_or_render

from lightning_dp.help_format import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "bench" / "de_techniques"
PAGE = ROOT / "docs" / "de_techniques.md"
FIGURE = ROOT / "docs" / "de_techniques.png"
START, END = "<!-- de:start -->", "<!-- de:end -->"
SCRIPT = "bench/de_techniques.py"
#: The docs setup of configs/cifar10_offline.yaml that this comparison keeps (the expected batch is an option).
DEPTH, WIDTH, GROUPS, LR, MAX_GRAD_NORM, DELTA, CLIPPING = 10, 1, 16, 2.0, 1.0, 1e-5, "flat"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 4, 8], help="augmentation multiplicities K")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps of each run")
    parser.add_argument("--batch-size", type=int, default=128, help="expected (Poisson) batch size, in examples")
    parser.add_argument("--target-epsilon", type=float, default=3.0)
    parser.add_argument("--ema-decay", type=float, default=0.9, help="decay of the weights' moving average")
    parser.add_argument("--ema-start", type=int, default=None,
                        help="first step (0-based) the average takes in (default: a quarter of --steps)")  # fmt: skip
    parser.add_argument("--eval-size", type=int, default=None, help="test images evaluated (default: all 10,000)")
    parser.add_argument("--data-dir", default=None, help="the data root holding cifar10/ (default: $LIGHTNING_DP_DATA)")
    add_record_options(parser, RECORDS.relative_to(ROOT))
    args = parser.parse_args(argv)
    if args.ema_start is None:
        args.ema_start = args.steps // 4
    if not 0 < args.ema_decay < 1:
        parser.error(f"--ema-decay must be in (0, 1), got {args.ema_decay}")
    if not 0 <= args.ema_start < args.steps:
        parser.error(f"--ema-start must be a step of the run, in [0, {args.steps}), got {args.ema_start}")
    return args


# --------------------------------------------------------------------------------------------------------- runs
def raw_weights_keeper() -> Any:
    """A callback, listed BEFORE ``EMAWeightAveraging``: times the training (``train_seconds``, and the process's CPU
    time ``train_cpu_seconds``), keeps a copy of the last iterate (``raw``) at the end of training, before the
    averaging callback copies the average into the model, and at the end of fit (the averaged weights in the model)
    evaluates both on the test loader (``results``: ``raw_acc``, ``ema_acc`` in percent, ``ema_raw_distance`` the L2
    norm of their difference), leaving the averaged weights in the model."""
    import lightning.pytorch as pl
    import torch

    class RawWeightsKeeper(pl.Callback):
        def __init__(self) -> None:
            self.start = self.cpu_start = 0.0
            self.train_seconds = self.train_cpu_seconds = 0.0
            self.raw: dict[str, torch.Tensor] = {}
            self.results: dict[str, float] = {}

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.train_seconds = time.perf_counter() - self.start
            self.train_cpu_seconds = time.process_time() - self.cpu_start
            self.raw = {name: value.detach().clone() for name, value in pl_module.state_dict().items()}

        def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            loader = trainer.datamodule.test_dataloader()
            averaged = {name: value.detach().clone() for name, value in pl_module.state_dict().items()}
            ema_accuracy = pl_module.accuracy(loader)["accuracy"]
            pl_module.load_state_dict(self.raw)
            raw_accuracy = pl_module.accuracy(loader)["accuracy"]
            pl_module.load_state_dict(averaged)
            distance = sum(float((averaged[n].double() - self.raw[n].double()).square().sum()) for n in averaged)
            self.results = {"raw_acc": raw_accuracy, "ema_acc": ema_accuracy, "ema_raw_distance": distance**0.5}

    return RawWeightsKeeper()


def run_one(args: argparse.Namespace, k: int, seed: int) -> dict[str, Any]:
    """One DP training of the docs setup with ``K = k`` and ``seed``, evaluated with its raw and averaged weights."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import EMAWeightAveraging

    from lightning_dp import DPStrategy
    from lightning_dp.recipes.cifar import CifarDataModule, WideResNetClassifier

    start, cpu_start = time.perf_counter(), time.process_time()
    pl.seed_everything(seed, verbose=False)
    strategy = DPStrategy(
        target_epsilon=args.target_epsilon,
        target_delta=DELTA,
        max_grad_norm=MAX_GRAD_NORM,
        noise="gaussian",
        clipping=CLIPPING,
        augmentation_multiplicity=k,
        seed=seed,
        device="cpu",
    )
    model = WideResNetClassifier(depth=DEPTH, width=WIDTH, groups=GROUPS, lr=LR, augmentation_multiplicity=k)
    data = CifarDataModule(data_dir=args.data_dir, batch_size=args.batch_size, eval_size=args.eval_size)
    keeper = raw_weights_keeper()
    ema = EMAWeightAveraging(decay=args.ema_decay, update_starting_at_step=args.ema_start)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        strategy=strategy,
        callbacks=[keeper, ema],  # the keeper first: it copies the raw weights before EMA replaces them
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=data)
    summary = strategy.privacy_engine.summary()
    return {
        "k": k,
        "seed": seed,
        **keeper.results,
        "epsilon": summary["epsilon"],
        "noise_multiplier": summary["noise_multiplier"],
        "steps": summary["steps"],
        "sample_rate": summary["sample_rate"],
        "train_seconds": round(keeper.train_seconds, 2),
        "run_seconds": round(time.perf_counter() - start, 2),
        "train_cpu_seconds": round(keeper.train_cpu_seconds, 2),
        "run_cpu_seconds": round(time.process_time() - cpu_start, 2),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every ``(K, seed)``, seeds outermost; each run is printed as one JSON line as it ends."""
    import warnings

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_dp").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    runs = []
    for seed in args.seeds:
        for k in args.ks:
            runs.append(run_one(args, k, seed))
            print(json.dumps(runs[-1]), flush=True)
    return {"runs": runs}


# ------------------------------------------------------------------------------------------------------ render
def mean_std(values: list[float]) -> tuple[float, float]:
    """The mean and the sample standard deviation (0 for one value)."""
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per ``K`` (in the order of the first runs): the raw and averaged accuracies' and their per-run
    differences' mean and standard deviation over the seeds, the first run's epsilon and noise multiplier (one
    calibration for every ``K``), the mean training and run seconds, and the seed count."""
    out = []
    for k in dict.fromkeys(run["k"] for run in record["runs"]):
        runs = [run for run in record["runs"] if run["k"] == k]
        raw, ema = mean_std([r["raw_acc"] for r in runs]), mean_std([r["ema_acc"] for r in runs])
        gain = mean_std([r["ema_acc"] - r["raw_acc"] for r in runs])
        out.append(
            {
                "k": k,
                "raw_acc": raw[0],
                "raw_acc_std": raw[1],
                "ema_acc": ema[0],
                "ema_acc_std": ema[1],
                "ema_gain": gain[0],
                "ema_gain_std": gain[1],
                "epsilon": runs[0]["epsilon"],
                "noise_multiplier": runs[0]["noise_multiplier"],
                "train_seconds": statistics.mean(r["train_seconds"] for r in runs),
                "run_seconds": statistics.mean(r["run_seconds"] for r in runs),
                "seeds": len(runs),
            }
        )
    return out


def markdown(record: dict[str, Any]) -> str:
    """A record rendered: the setting, the command that made it, and one table line per ``K`` (accuracies in
    percent, mean +- std over the seeds)."""
    env, args = record["environment"], record["args"]
    eval_size = "all 10,000" if args["eval_size"] is None else f"{args['eval_size']:,}"
    lines = [
        f"**WRN-10-1, {args['steps']} steps of expected batch {args['batch_size']}, target epsilon "
        f"{args['target_epsilon']:g}, EMA decay {args['ema_decay']:g} from step {args['ema_start']}** "
        f"(seeds {args['seeds']}; test images: {eval_size}; torch {env['torch']}, {env['threads']} threads)",
        "",
        "```bash",
        record["command"],
        "```",
        "",
        "| K | raw weights: accuracy | EMA weights: accuracy | EMA - raw (paired) | epsilon | noise multiplier "
        "| train s | run s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows(record):
        lines.append(
            f"| {row['k']} | {row['raw_acc']:.2f} +- {row['raw_acc_std']:.2f} | "
            f"{row['ema_acc']:.2f} +- {row['ema_acc_std']:.2f} | {row['ema_gain']:+.2f} +- {row['ema_gain_std']:.2f} | "
            f"{row['epsilon']:.3f} | {row['noise_multiplier']:.4g} | {row['train_seconds']:.0f} | "
            f"{row['run_seconds']:.0f} |"
        )
    total = sum(run["run_seconds"] for run in record["runs"])
    lines += ["", f"Test accuracy in percent, mean +- sample std over the seeds; {total / 60:.1f} minutes in all."]
    return "\n".join(lines)


def write_figure(record: dict[str, Any], path: Path) -> None:
    """Accuracy against ``K``: each seed's run (dots) and the means (lines), raw and averaged weights."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = rows(record)
    ks = [row["k"] for row in table]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for key, label, color, shift in (
        ("raw_acc", "raw weights", "tab:blue", 0.97),
        ("ema_acc", "EMA", "tab:orange", 1.03),
    ):
        runs = record["runs"]
        ax.scatter(
            [run["k"] * shift for run in runs], [run[key] for run in runs], color=color, alpha=0.45, s=18,
            label=f"{label} (one run per seed)",
        )  # fmt: skip
        ax.plot(ks, [row[key] for row in table], "o-", color=color, label=f"{label} (mean)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    ax.set_xlabel("augmentation multiplicity K")
    ax.set_ylabel("test accuracy (%)")
    args = record["args"]
    ax.set_title(
        f"CIFAR-10 subset, WRN-10-1, {args['steps']} steps, expected batch {args['batch_size']}, "
        f"epsilon {args['target_epsilon']:g}",
        fontsize=10,
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def render() -> None:
    render_records_and_figure(RECORDS, markdown, PAGE, START, END, write_figure, FIGURE)


def main(argv: list[str] | None = None) -> None:
    run_or_render(
        parse_args(argv),
        run,
        render,
        script=SCRIPT,
        records=RECORDS,
        report_lines=lambda record: [json.dumps(row) for row in rows(record)] + ["", markdown(record)],
    )


if __name__ == "__main__":
    main()
