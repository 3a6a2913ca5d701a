"""Group-wise (per-layer) clipping against flat clipping at the same total bound on the digits demo
(docs/group_clipping.md).

    python bench/group_clipping.py --record digits       # the runs, then render docs/group_clipping.md
    python bench/group_clipping.py --render              # only re-render from docs/bench/group_clipping/*.json

Each variant trains the demo's CNN (``lightning_dp.cli.demo.run_demo``: 15 epochs, expected batch 128, Gaussian noise
calibrated for the same epsilon, SGD at learning rate 1) once per seed, with flat clipping at ``C`` or with
``clipping_groups="per_layer"`` at the same ``C`` split evenly over the ``G`` layers (``C / sqrt(G)`` each, He et al.
2022, Section 3), for ``C`` of 0.1 and 1: every variant has sensitivity ``C`` and so the same noise and epsilon.
Reported per variant: the test accuracy (mean and standard deviation over the seeds), the epsilon and the noise
multiplier (one calibration, the same for all). A record keeps every run's numbers.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from demo_variants import comparison_main, run_variants, variant_rows, variant_table
from records import render_records_and_figure

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
    return run_variants(args, VARIANTS, lambda result, _: {"group_bounds": result["privacy"].get("clipping_groups")})


def rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per variant: accuracy mean and std over the seeds, epsilon, noise multiplier, the group bounds."""
    return variant_rows(record, lambda runs: {"group_bounds": runs[0]["group_bounds"]})


def markdown(record: dict[str, Any]) -> str:
    return variant_table(record, rows(record), "bound per group", lambda row: bounds_text(row["group_bounds"]))


def bounds_text(bounds: dict[str, float] | None) -> str:
    """``-`` for flat clipping; ``G x C_g`` for equal bounds; else each group's ``label: C_g``."""
    if not bounds:
        return "-"
    values = list(bounds.values())
    if len(set(values)) == 1:
        return f"{len(values)} x {values[0]:.3g}"
    return ", ".join(f"{label}: {value:.3g}" for label, value in bounds.items())


def plot(record: dict[str, Any], path: Path) -> None:
    """Test accuracy per variant: one dot per seed, a bar at the mean."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6.5, 3.5))
    for position, variant in enumerate(VARIANTS):
        accuracies = [100 * run["test_acc"] for run in record["runs"] if run["variant"] == variant]
        color = "C1" if "per_layer" in variant else "C0"
        axis.scatter([position] * len(accuracies), accuracies, color=color, zorder=3)
        axis.hlines(sum(accuracies) / len(accuracies), position - 0.25, position + 0.25, color=color)
    axis.set_xticks(range(len(VARIANTS)), list(VARIANTS))
    axis.set_ylabel("test accuracy (%)")
    axis.set_title("digits CNN, same sensitivity C: flat against per-layer clipping", fontsize=10)
    axis.grid(True, axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def render() -> None:
    render_records_and_figure(RECORDS, markdown, PAGE, START, END, plot, PAGE.with_suffix(".png"))


def main() -> None:
    comparison_main(__doc__, "bench/group_clipping.py", RECORDS, run, render, rows)


if __name__ == "__main__":
    main()
