"""What the digits-demo comparisons share (bench/adaptive_clipping.py, bench/group_clipping.py): their command line,
one row per variant averaged over the seeds, and the rendered table of a record."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from records import add_record_options, mean_std, plural, run_or_render

from lightning_dp.utils.help_format import HelpFormatter


def add_demo_options(parser: argparse.ArgumentParser) -> None:
    """``--epochs`` (15), ``--target-epsilon`` (3), ``--seeds`` (0 1 2) and ``--threads`` (torch's default) of the
    demo runs."""
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--target-epsilon", type=float, default=3.0)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's own)")


def run_variants(
    args: argparse.Namespace,
    variants: dict[str, dict[str, Any]],
    measure: Callable[[dict[str, Any], list[Any]], dict[str, Any]],
    callbacks: Callable[[], list[Any]] = list,
) -> dict[str, Any]:
    """Train the demo (``lightning_dp.cli.demo.run_demo``) once per seed and variant (``variants``: name -> the demo's
    options), with fresh ``callbacks()`` each time, on ``args.threads`` torch threads when set (an ``args`` without
    it, or with ``None``, leaves torch's); each run keeps its test accuracy, epsilon, noise multiplier and
    ``measure(result, callbacks)``'s entries, and is printed as one JSON line (list values left out)."""
    import torch

    from lightning_dp.cli.demo import run_demo

    if getattr(args, "threads", None) is not None:
        torch.set_num_threads(args.threads)

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning_dp").setLevel(logging.WARNING)
    runs = []
    for seed in args.seeds:
        for variant, options in variants.items():
            extra = callbacks()
            result = run_demo(
                target_epsilon=args.target_epsilon,
                epochs=args.epochs,
                seed=seed,
                progress_bar=False,
                callbacks=extra,
                **options,
            )
            runs.append(
                {
                    "variant": variant,
                    "seed": seed,
                    "test_acc": result["test_acc"],
                    "epsilon": result["epsilon"],
                    "noise_multiplier": result["privacy"]["noise_multiplier"],
                    **measure(result, extra),
                }
            )
            print(json.dumps({k: v for k, v in runs[-1].items() if not isinstance(v, list)}), flush=True)
    return {"runs": runs}


def variant_rows(
    record: dict[str, Any], per_variant: Callable[[list[dict[str, Any]]], dict[str, Any]]
) -> list[dict[str, Any]]:
    """One row per variant of ``record["runs"]``, in the order first run: the test accuracy's mean and sample
    standard deviation over the seeds, the seed count, the first run's epsilon and noise multiplier (one calibration
    for all), and ``per_variant(runs)``'s entries."""
    out = []
    for variant in dict.fromkeys(run["variant"] for run in record["runs"]):
        runs = [run for run in record["runs"] if run["variant"] == variant]
        test_acc, test_acc_std = mean_std([run["test_acc"] for run in runs])
        out.append(
            {
                "variant": variant,
                "test_acc": test_acc,
                "test_acc_std": test_acc_std,
                "epsilon": runs[0]["epsilon"],
                "noise_multiplier": runs[0]["noise_multiplier"],
                "seeds": len(runs),
                **per_variant(runs),
            }
        )
    return out


def record_heading(record: dict[str, Any], setting: str) -> list[str]:
    """The lines above a digits record's table: ``setting`` in bold with the seeds, torch and threads, then the command
    that made the record."""
    env, args = record["environment"], record["args"]
    return [
        f"**Digits CNN, {setting}** (seeds {args['seeds']}; torch {env['torch']}, {plural(env['threads'], 'thread')})",
        "",
        "```bash",
        record["command"],
        "```",
        "",
    ]


def save_figure(figure: Any, axes: Any, path: Path, *, xlabel: str, ylabel: str, title: str) -> None:
    """Label ``axes`` (a light grid, a small legend), write ``figure`` to ``path`` (PNG, 120 dpi) and close it."""
    import matplotlib.pyplot as plt

    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def variant_table(
    record: dict[str, Any], rows: list[dict[str, Any]], column: str, cell: Callable[[dict[str, Any]], str]
) -> str:
    """A record rendered: the setting (epochs, target epsilon, seeds, torch, threads), the command that made it, and
    one line per row (accuracy in percent, mean +- std), with the script's own ``column`` filled by ``cell(row)``."""
    args = record["args"]
    lines = [
        *record_heading(record, f"{args['epochs']} epochs, target epsilon {args['target_epsilon']:g}"),
        f"| variant | test accuracy (mean +- std) | {column} | epsilon | noise multiplier |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['variant']} | {100 * row['test_acc']:.1f} +- {100 * row['test_acc_std']:.1f} | {cell(row)} | "
            f"{row['epsilon']:.3f} | {row['noise_multiplier']:.4g} |"
        )
    return "\n".join(lines)


def comparison_main(
    description: str,
    script: str,
    records: Path,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    render: Callable[[], None],
    rows: Callable[[dict[str, Any]], list[dict[str, Any]]],
) -> None:
    """A comparison's command line: ``--render`` re-renders its page from the records; otherwise run it, print one
    JSON row per variant, and with ``--record NAME`` keep the record and re-render (:func:`records.finish`)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    add_demo_options(parser)
    add_record_options(parser, records)
    run_or_render(
        parser.parse_args(),
        run,
        render,
        script=script,
        records=records,
        report_lines=lambda record: [json.dumps(row) for row in rows(record)],
    )
