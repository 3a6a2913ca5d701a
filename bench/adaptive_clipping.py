"""Adaptive and automatic clipping against fixed clipping bounds, well and badly chosen, on the digits demo
(docs/adaptive_clipping.md).

    python bench/adaptive_clipping.py --threads 1 --record digits   # the runs, then render docs/adaptive_clipping.md
    python bench/adaptive_clipping.py --render              # only re-render from docs/bench/adaptive_clipping/*.json
    python bench/recipes.py --task sst2_full --variants automatic-eps3 adaptive-eps3 --seeds 0 1 2   # the SST-2 runs

Each variant trains the demo's CNN (``lightning_dp.cli.demo.run_demo``: 15 epochs, expected batch 128, Gaussian noise
calibrated for the same epsilon, SGD at learning rate 1) once per seed, the variants interleaved within each seed:
fixed bounds ``C`` of 0.1, 1 (the demo's default) and 10; adaptive clipping (``target_unclipped_quantile`` 0.5, the
other options at their defaults) started from 0.1 and from 10; and automatic clipping (``clipping_fn="automatic"``,
Bu et al. 2023, Section 4: ``C`` = 1, ``gamma`` = 0.01) at learning rates 0.5, 1 and 2, since with it the learning
rate takes the role of ``C``. Every variant has sensitivity ``C`` at each step and the same noise multiplier, so the
same epsilon. Reported per variant: the test accuracy (mean and standard deviation over the seeds), the bound at the
end (mean over the seeds; automatic clipping's is its fixed ``C``), and the epsilon every run reports (one
calibration, the same for all); the figure shows the bound after each step of the first seed's runs with fixed and
adaptive bounds. A record keeps every run's numbers.

The SST-2 table of the same page comes from the full-data recipe's records (docs/recipes/sst2_full/, written by
``bench/recipes.py``): its fixed bound ``C`` = 1 at epsilon 3 (``gaussian-eps3``) against automatic clipping at that
``C`` (``automatic-eps3``) and adaptive clipping towards the median started from it (``adaptive-eps3``), each
calibrated for epsilon 3 by the recipe; per variant the dev accuracy (mean and standard deviation over the seeds
recorded), the bound at the end (adaptive: the last logged ``dp/max_grad_norm``, mean over the seeds), the epsilon and
the noise multiplier the runs report.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import recipe_runs
from demo_variants import comparison_main, run_variants, save_figure, variant_rows, variant_table
from records import render_records, replace_between_markers

from recipes import load_results

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "bench" / "adaptive_clipping"
PAGE = ROOT / "docs" / "adaptive_clipping.md"
FIGURE = ROOT / "docs" / "adaptive_clipping.png"
START, END = "<!-- adaptive:start -->", "<!-- adaptive:end -->"
SST2_START, SST2_END = "<!-- adaptive-sst2:start -->", "<!-- adaptive-sst2:end -->"
#: the SST-2 full-data recipe's runs compared (``bench/recipes.py`` variants) -> the row's name.
SST2_VARIANTS = {"gaussian-eps3": "fixed C=1", "automatic-eps3": "automatic C=1", "adaptive-eps3": "adaptive from C=1"}
#: the learning rates of the automatic-clipping runs (C = 1 and gamma = 0.01, the demo's and the option's defaults).
AUTOMATIC_LEARNING_RATES = (0.5, 1.0, 2.0)
#: variant -> the demo's options (the clipping bound; for the adaptive runs the quantile; for the automatic runs the
#: clip function and the learning rate, the demo's 1 otherwise).
VARIANTS: dict[str, dict[str, Any]] = {
    "fixed C=0.1": {"max_grad_norm": 0.1},
    "fixed C=1": {"max_grad_norm": 1.0},
    "fixed C=10": {"max_grad_norm": 10.0},
    "adaptive from C=0.1": {"max_grad_norm": 0.1, "target_unclipped_quantile": 0.5},
    "adaptive from C=10": {"max_grad_norm": 10.0, "target_unclipped_quantile": 0.5},
    **{f"automatic C=1, lr={lr:g}": {"clipping_fn": "automatic", "lr": lr} for lr in AUTOMATIC_LEARNING_RATES},
}
#: the first words of the variants whose bound the figure draws (automatic clipping's is fixed at C = 1).
FIGURE_VARIANTS = ("fixed", "adaptive")


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
    return run_variants(
        args, VARIANTS, lambda _, callbacks: {"bounds": callbacks[0].bounds}, lambda: [bound_recorder()]
    )


def rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per variant: accuracy mean and std over the seeds, final bound (mean), epsilon."""
    return variant_rows(record, lambda runs: {"final_bound": statistics.mean(run["bounds"][-1] for run in runs)})


def markdown(record: dict[str, Any]) -> str:
    return variant_table(record, rows(record), "bound at the end", lambda row: f"{row['final_bound']:.3g}")


def write_figure(record: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seed = record["args"]["seeds"][0]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for run in record["runs"]:
        if run["seed"] == seed and run["variant"].startswith(FIGURE_VARIANTS):
            style = "-" if run["variant"].startswith("adaptive") else ":"
            ax.plot(range(1, len(run["bounds"]) + 1), run["bounds"], style, label=run["variant"])
    ax.set_yscale("log")
    title = f"Clipping bound per step, digits CNN, seed {seed}"
    save_figure(fig, ax, FIGURE, xlabel="step", ylabel="clipping bound C", title=title)


def final_bound(run: dict[str, Any]) -> float:
    """The clipping bound at the end of a recipe run: the last ``dp/max_grad_norm`` its history logged (adaptive
    clipping), else its fixed ``max_grad_norm``."""
    logged = [row["dp/max_grad_norm"] for row in run.get("history", []) if "dp/max_grad_norm" in row]
    return float(logged[-1]) if logged else float(run["privacy"]["max_grad_norm"])


def sst2_markdown(results: dict[str, list[dict[str, Any]]]) -> str:
    """The SST-2 table (:data:`SST2_VARIANTS` recorded in ``results``, ``bench/recipes.py``'s ``load_results``) and
    the commands of its runs."""
    shown = recipe_runs.compared(results, list(SST2_VARIANTS))
    if not shown:
        return "(no run recorded yet)"
    first = next(iter(shown.values()))[0]
    lines = [
        f"**SST-2, all {first['train_size']:,} training sentences, target epsilon 3** (docs/recipes/sst2_full.md; "
        f"torch {first['environment']['torch']})",
        "",
        "| variant | dev accuracy (mean +- std) | seeds | bound at the end | epsilon | noise multiplier | CPU "
        "(threads) |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, runs in shown.items():
        row = recipe_runs.summary("sst2_full", runs)
        lines.append(
            f"| {SST2_VARIANTS[variant]} | {row['metric']} | {row['seeds']} | "
            f"{statistics.mean(final_bound(run) for run in runs):.3g} | {row['epsilon']} | "
            f"{row['noise_multiplier']} | {row['machines']} |"
        )
    return "\n".join([*lines, "", *recipe_runs.commands("sst2_full", shown)])


def render() -> None:
    render_records(RECORDS, markdown, PAGE, START, END)
    replace_between_markers(PAGE, sst2_markdown(load_results("sst2_full")), SST2_START, SST2_END)
    records = sorted(RECORDS.glob("*.json"))
    if records:
        write_figure(json.loads(records[-1].read_text(encoding="utf-8")))


def main() -> None:
    comparison_main(__doc__, "bench/adaptive_clipping.py", RECORDS, run, render, rows)


if __name__ == "__main__":
    main()
