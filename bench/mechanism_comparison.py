"""Digits demo accuracy versus reported epsilon for Gaussian, LAP2 and PLRV-O noise (sound accounting), with the
papers' (unsound) accountant's epsilon for the same noise beside it.

For each mechanism and target epsilon the noise is calibrated with the mechanism's sound default accountant
(``pld`` for Gaussian, ``lap2`` and ``plrv`` for the Laplace family, docs/design.md section 6), the demo CNN is trained
end to end, and the paper-mode epsilon (``lap2-paper`` / ``plrv-paper``) of exactly the same run (same noise
parameters, sample rate, steps and parameter count) is computed afterwards.

Usage: ``python bench/mechanism_comparison.py [--epochs 15] [--seeds 0 1 2] [--clipping auto] [--out docs]`` writes
``mechanisms_digits.md`` (the table) and ``mechanisms_digits.png`` (the figure) into ``--out``. ``--clipping`` is the
demo's engine (default ``auto``); docs/mechanisms.md was recorded with ``--clipping flat``, the default then.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from records import mean_std

from lightning_dp.cli.demo import run_demo
from lightning_dp.mechanisms import make_mechanism
from lightning_dp.mechanisms.calibration import mechanism_epsilon
from lightning_dp.utils.help_format import HelpFormatter

PAPER_ACCOUNTANT = {"lap2": "lap2-paper", "plrv": "plrv-paper"}
MECHANISM_KEYS = ("noise_multiplier", "noise_scale", "gamma_shape", "gamma_scale", "max_grad_norm")


def paper_epsilon(privacy: dict) -> float | None:
    """The paper accountant's epsilon for the run's noise, or ``None`` where there is no paper mode."""
    name = PAPER_ACCOUNTANT.get(privacy["noise"])
    if name is None:
        return None
    return mechanism_epsilon(
        make_mechanism(privacy["noise"], **{k: privacy[k] for k in MECHANISM_KEYS if k in privacy}),
        sample_rate=privacy["sample_rate"],
        steps=privacy["steps"],
        delta=privacy["delta"],
        num_params=privacy["num_params"],
        accountant=name,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[0.5, 1.0, 3.0])
    parser.add_argument("--noises", nargs="+", default=["gaussian", "lap2", "plrv"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--clipping", default="auto", help="per-sample clipping engine of every run (default auto)")
    parser.add_argument("--out", type=Path, default=Path("docs"))
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    rows = []
    for noise in args.noises:
        for target in args.epsilons:
            accuracies = []
            for seed in args.seeds:
                result = run_demo(
                    target_epsilon=target,
                    epochs=args.epochs,
                    noise=noise,
                    clipping=args.clipping,
                    seed=seed,
                    progress_bar=False,
                )
                accuracies.append(result["test_acc"])
            privacy = result["privacy"]  # identical across seeds: calibration does not depend on the seed
            test_acc, test_acc_std = mean_std(accuracies)
            row = {
                "noise": noise,
                "target_epsilon": target,
                "test_acc": test_acc,
                "test_acc_std": test_acc_std,
                "epsilon": privacy["epsilon"],
                "accountant": privacy["accountant"],
                "paper_epsilon": paper_epsilon(privacy),
                "params": {k: privacy[k] for k in MECHANISM_KEYS if k in privacy},
                "steps": privacy["steps"],
                "sample_rate": privacy["sample_rate"],
                "num_params": privacy["num_params"],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_table(rows, args, args.out / "mechanisms_digits.md")
    write_figure(rows, args.out / "mechanisms_digits.png")


def write_table(rows: list[dict], args: argparse.Namespace, path: Path) -> None:
    first = rows[0]
    lines = [
        f"Digits CNN ({first['num_params']} parameters), {args.epochs} epochs, sample rate "
        f"{first['sample_rate']:.4f}, {first['steps']} steps, delta 1e-5, max_grad_norm 1; test accuracy is the "
        f"mean +- std over seeds {args.seeds}.",
        "",
        "| noise | target eps | test acc | reported eps (sound) | accountant | paper-mode eps | noise parameters |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        paper = f"{r['paper_epsilon']:.3f}" if r["paper_epsilon"] is not None else "n/a"
        params = ", ".join(f"{k}={v:.4g}" for k, v in r["params"].items() if k != "max_grad_norm")
        lines.append(
            f"| {r['noise']} | {r['target_epsilon']:g} | {r['test_acc']:.3f} +- {r['test_acc_std']:.3f} | "
            f"{r['epsilon']:.3f} | "
            f"{r['accountant']} | {paper} | {params} |"
        )
    path.write_text("\n".join(lines) + "\n")


def write_figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for noise in dict.fromkeys(r["noise"] for r in rows):
        mine = [r for r in rows if r["noise"] == noise]
        ax.errorbar(
            [r["epsilon"] for r in mine],
            [r["test_acc"] for r in mine],
            yerr=[r["test_acc_std"] for r in mine],
            marker="o",
            capsize=3,
            label=f"{noise} (sound)",
        )
        if mine[0]["paper_epsilon"] is not None:
            ax.plot(
                [r["paper_epsilon"] for r in mine],
                [r["test_acc"] for r in mine],
                marker="x",
                linestyle="--",
                label=f"{noise} (paper-mode epsilon, same runs)",
            )
    ax.set_xscale("log")
    ax.set_xlabel("reported epsilon (delta = 1e-5)")
    ax.set_ylabel("test accuracy")
    ax.set_title("DP-SGD on digits: accuracy vs epsilon")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
