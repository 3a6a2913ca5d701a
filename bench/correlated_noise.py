"""DP-SGD against banded and BLT matrix-factorization noise on the digits demo, at one target epsilon per record
(docs/correlated_noise.md).

    python bench/correlated_noise.py --target-epsilon 3 --threads 1 --record digits_eps3   # runs, then render
    python bench/correlated_noise.py --render            # only re-render from docs/bench/correlated_noise/*.json

Each variant trains the demo's CNN (``lightning_dp.cli.demo.run_demo``: 15 epochs, expected batch 128, SGD at
learning rate 1, C = 1) once per seed, its noise calibrated for the same target epsilon by its own accountant: DP-SGD
(``pld``), ``noise_correlation="banded"`` with bands 2, 4 and 8 (``banded-mf``: cyclic Poisson sampling over ``b``
groups at rate ``b q``, the strategy optimised for the run's steps) and ``noise_correlation="blt"`` with 4 buffers
(``blt-minsep``: ``floor(1 / q)`` cyclic groups, no amplification credited). Reported per variant: the test accuracy
(mean and standard deviation over the seeds), the epsilon every run reports and the noise multiplier. The figure shows
the accuracy against the target epsilon of every record.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from demo_variants import comparison_main, run_variants, save_figure, variant_rows, variant_table
from records import render_records

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "bench" / "correlated_noise"
PAGE = ROOT / "docs" / "correlated_noise.md"
FIGURE = ROOT / "docs" / "correlated_noise.png"
START, END = "<!-- banded:start -->", "<!-- banded:end -->"
BANDS = (2, 4, 8)
#: variant -> the demo's options (DP-SGD is the band 1 of the same mechanism, with its own default accountant).
VARIANTS: dict[str, dict[str, Any]] = {
    "DP-SGD": {},
    **{f"banded b={b}": {"noise_correlation": "banded", "correlation_band": b} for b in BANDS},
    "BLT d=4": {"noise_correlation": "blt", "correlation_buffers": 4},
}


def run(args: Any) -> dict[str, Any]:
    return run_variants(args, VARIANTS, lambda result, callbacks: {})


def rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per variant: accuracy mean and std over the seeds, epsilon, noise multiplier."""
    return variant_rows(record, lambda runs: {})


def noise(variant: str) -> str:
    """A variant's noise: ``banded, b = B`` (``b = 1`` for DP-SGD) or ``BLT, d = D``."""
    if variant.startswith("BLT"):
        return "BLT, d = " + variant.removeprefix("BLT d=")
    return "banded, b = " + (variant.removeprefix("banded b=") if variant.startswith("banded") else "1 (DP-SGD)")


def markdown(record: dict[str, Any]) -> str:
    return variant_table(record, rows(record), "noise", lambda row: noise(row["variant"]))


def write_figure(records: list[dict[str, Any]]) -> None:
    """Test accuracy (mean, with the standard deviation as error bars) against the target epsilon, one line per
    variant, from every record."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points: dict[str, list[tuple[float, float, float]]] = {}
    for record in sorted(records, key=lambda r: r["args"]["target_epsilon"]):
        for row in rows(record):
            points.setdefault(row["variant"], []).append(
                (record["args"]["target_epsilon"], 100 * row["test_acc"], 100 * row["test_acc_std"])
            )
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for variant, values in points.items():
        epsilons, accuracies, spreads = zip(*values, strict=True)
        ax.errorbar(epsilons, accuracies, yerr=spreads, marker="o", capsize=3, label=variant)
    ax.set_xscale("log")
    title = "Digits CNN: DP-SGD against banded and BLT MF noise"
    save_figure(fig, ax, FIGURE, xlabel="target epsilon", ylabel="test accuracy (%)", title=title)


def render() -> None:
    render_records(RECORDS, markdown, PAGE, START, END)
    records = [json.loads(path.read_text(encoding="utf-8")) for path in sorted(RECORDS.glob("*.json"))]
    if records:
        write_figure(records)


def main() -> None:
    comparison_main(__doc__, "bench/correlated_noise.py", RECORDS, run, render, rows)


if __name__ == "__main__":
    main()
