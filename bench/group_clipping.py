"""Group-wise (per-layer) clipping against flat clipping at the same total bound on the digits demo
(docs/group_clipping.md).

    python bench/group_clipping.py --record digits       # the runs, then render docs/group_clipping.md
    python bench/group_clipping.py --render              # only re-render from docs/bench/group_clipping/*.json

Each variant trains the demo's CNN (``lightning_dp.demo.run_demo``: 15 epochs, expected batch 128, Gaussian noise
calibrated for the same epsilon, SGD at learning rate 1) once per seed, with flat clipping at ``C`` or with
``clipping_groups="per_layer"`` at the same ``C`` split evenly over the ``G`` layers (``C / sqrt(G)`` each, He et al.
2022, Section 3), for ``C`` of 0.1 and 1: every variant has sensitivity ``C`` and so the same noise and epsilon.
Reported per variant: the test accuracy (mean and standard deviation over the seeds), the epsilon and the noise
multiplier (one calibration, the same for all). A record keeps every run's numbers.
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
RECORDS = ROOT / "docs" / "bench" / "group_clipping"
PAGE = ROOT / "docs" / "group_clipping.md"
START, END = "<!-- groups:start -->", "<!-- groups:end -->"
#: variant -> the demo's options.
VARIANTS: dict[str, dict[str, Any]] = {
    "flat, C=0.1": {"max_grad_norm": 0.1},
    "per_layer, C=0.1": {"max_grad_norm": 0.1, "clipping_groups": "per_layer"},
    "flat, C=1": {"max_grad_norm": 1.0},
    "per_layer, C=1": {"max_grad_norm": 1.0, "clipping_groups": "per_layer"},
}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lightning_dp.demo import run_demo

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_dp").setLevel(logging.WARNING)
    runs = []
    for seed in args.seeds:
        for variant, options in VARIANTS.items():
            result = run_demo(
                target_epsilon=args.target_epsilon, epochs=args.epochs, seed=seed, progress_bar=False, **options
            )
            privacy = result["privacy"]
            runs.append(
                {
                    "variant": variant,
                    "seed": seed,
                    "test_acc": result["test_acc"],
                    "epsilon": result["epsilon"],
                    "noise_multiplier": privacy["noise_multiplier"],
                    "group_bounds": privacy.get("clipping_groups"),  # {group label: C_g}, None for flat
                }
            )
            print(json.dumps(runs[-1]), flush=True)
    return {"runs": runs}


def rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per variant: accuracy mean and std over the seeds, epsilon, noise multiplier, the group bounds."""
    out = []
    for variant in dict.fromkeys(run["variant"] for run in record["runs"]):
        runs = [run for run in record["runs"] if run["variant"] == variant]
        accuracies = [run["test_acc"] for run in runs]
        out.append(
            {
                "variant": variant,
                "test_acc": statistics.mean(accuracies),
                "test_acc_std": statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
                "epsilon": runs[0]["epsilon"],
                "noise_multiplier": runs[0]["noise_multiplier"],
                "group_bounds": runs[0]["group_bounds"],
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
        "| variant | test accuracy (mean +- std) | bound per group | epsilon | noise multiplier |",
        "|---|---|---|---|---|",
    ]
    for row in rows(record):
        lines.append(
            f"| {row['variant']} | {100 * row['test_acc']:.1f} +- {100 * row['test_acc_std']:.1f} | "
            f"{bounds_text(row['group_bounds'])} | {row['epsilon']:.3f} | {row['noise_multiplier']:.4g} |"
        )
    return "\n".join(lines)


def bounds_text(bounds: dict[str, float] | None) -> str:
    """``-`` for flat clipping; ``G x C_g`` for equal bounds; else each group's ``label: C_g``."""
    if not bounds:
        return "-"
    values = list(bounds.values())
    if len(set(values)) == 1:
        return f"{len(values)} x {values[0]:.3g}"
    return ", ".join(f"{label}: {value:.3g}" for label, value in bounds.items())


def render() -> None:
    render_records(RECORDS, markdown, PAGE, START, END)


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
    finish(
        args,
        run(args),
        environment("cpu"),
        script="bench/group_clipping.py",
        records=RECORDS,
        render=render,
        report_lines=report_lines,
    )


if __name__ == "__main__":
    main()
