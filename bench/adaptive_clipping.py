"""Adaptive clipping against fixed clipping bounds, well and badly chosen, on the digits demo
(docs/adaptive_clipping.md).

    python bench/adaptive_clipping.py --record digits       # the runs, then render docs/adaptive_clipping.md
    python bench/adaptive_clipping.py --render              # only re-render from docs/bench/adaptive_clipping/*.json

Each variant trains the demo's CNN (``lightning_dp.demo.run_demo``: 15 epochs, expected batch 128, Gaussian noise
calibrated for the same epsilon, SGD at learning rate 1) once per seed: fixed bounds ``C`` of 0.1, 1 (the demo's
default) and 10, and adaptive clipping (``target_unclipped_quantile`` 0.5, the other options at their defaults)
started from 0.1 and from 10. Reported per variant: the test accuracy (mean and standard deviation over the seeds),
the bound at the end (mean over the seeds), and the epsilon every run reports (one calibration, the same for all);
the figure shows the bound after each step of the first seed's runs. A record keeps every run's numbers.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path
from typing import Any

from records import add_record_options, environment, finish, render_records

from lightning_dp.help_format import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "bench" / "adaptive_clipping"
PAGE = ROOT / "docs" / "adaptive_clipping.md"
FIGURE = ROOT / "docs" / "adaptive_clipping.png"
START, END = "<!-- adaptive:start -->", "<!-- adaptive:end -->"
#: variant -> the demo's options (the clipping bound, and for the adaptive runs the quantile).
VARIANTS: dict[str, dict[str, Any]] = {
    "fixed C=0.1": {"max_grad_norm": 0.1},
    "fixed C=1": {"max_grad_norm": 1.0},
    "fixed C=10": {"max_grad_norm": 10.0},
    "adaptive from C=0.1": {"max_grad_norm": 0.1, "target_unclipped_quantile": 0.5},
    "adaptive from C=10": {"max_grad_norm": 10.0, "target_unclipped_quantile": 0.5},
}


def bound_recorder() -> Any:
    """A Lightning callback keeping the clipping bound after every training step (``.bounds``)."""
    import lightning.pytorch as pl

    from lightning_dp.lightning.callbacks import privacy_engine_of

    class BoundRecorder(pl.Callback):
        def __init__(self) -> None:
            self.bounds: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.bounds.append(privacy_engine_of(trainer).current_max_grad_norm)

    return BoundRecorder()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_dp.demo import run_demo

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_dp").setLevel(logging.WARNING)
    runs = []
    for seed in args.seeds:
        for variant, options in VARIANTS.items():
            recorder = bound_recorder()
            result = run_demo(
                target_epsilon=args.target_epsilon,
                epochs=args.epochs,
                seed=seed,
                progress_bar=False,
                callbacks=[recorder],
                **options,
            )
            runs.append(
                {
                    "variant": variant,
                    "seed": seed,
                    "test_acc": result["test_acc"],
                    "epsilon": result["epsilon"],
                    "noise_multiplier": result["privacy"]["noise_multiplier"],
                    "bounds": recorder.bounds,
                }
            )
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "bounds"}), flush=True)
    return {"runs": runs}


def rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per variant: accuracy mean and std over the seeds, final bound (mean), epsilon."""
    out = []
    for variant in dict.fromkeys(run["variant"] for run in record["runs"]):
        runs = [run for run in record["runs"] if run["variant"] == variant]
        accuracies = [run["test_acc"] for run in runs]
        out.append(
            {
                "variant": variant,
                "test_acc": statistics.mean(accuracies),
                "test_acc_std": statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
                "final_bound": statistics.mean(run["bounds"][-1] for run in runs),
                "epsilon": runs[0]["epsilon"],
                "noise_multiplier": runs[0]["noise_multiplier"],
                "seeds": len(runs),
            }
        )
    return out


def markdown(record: dict[str, Any]) -> str:
    env = record["environment"]
    lines = [
        f"**Digits CNN, {record['args']['epochs']} epochs, target epsilon {record['args']['target_epsilon']:g}** "
        f"(seeds {record['args']['seeds']}; torch {env['torch']}, {env['threads']} threads)",
        "",
        "```bash",
        record["command"],
        "```",
        "",
        "| variant | test accuracy (mean +- std) | bound at the end | epsilon | noise multiplier |",
        "|---|---|---|---|---|",
    ]
    for row in rows(record):
        lines.append(
            f"| {row['variant']} | {100 * row['test_acc']:.1f} +- {100 * row['test_acc_std']:.1f} | "
            f"{row['final_bound']:.3g} | {row['epsilon']:.3f} | {row['noise_multiplier']:.4g} |"
        )
    return "\n".join(lines)


def write_figure(record: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed = record["args"]["seeds"][0]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for run in record["runs"]:
        if run["seed"] == seed:
            style = "-" if run["variant"].startswith("adaptive") else ":"
            ax.plot(range(1, len(run["bounds"]) + 1), run["bounds"], style, label=run["variant"])
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("clipping bound C")
    ax.set_title(f"Clipping bound per step, digits CNN, seed {seed}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(FIGURE, dpi=120)


def render() -> None:
    render_records(RECORDS, markdown, PAGE, START, END)
    records = sorted(RECORDS.glob("*.json"))
    if records:
        write_figure(json.loads(records[-1].read_text(encoding="utf-8")))


def report_lines(record: dict[str, Any]) -> list[str]:
    return [json.dumps(row) for row in rows(record)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--target-epsilon", type=float, default=3.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    add_record_options(parser, RECORDS)
    args = parser.parse_args()
    if args.render:
        render()
        return
    env = environment("cpu")
    finish(
        args,
        run(args),
        env,
        script="bench/adaptive_clipping.py",
        records=RECORDS,
        render=render,
        report_lines=report_lines,
    )


if __name__ == "__main__":
    main()
