"""Render the SST-2 table of docs/hf.md ("SST-2 with a real encoder (CPU)") from the example's recorded runs.

    python bench/sst2_hf.py --render    # re-render docs/hf.md from docs/bench/sst2_hf/*.json

Each record is the JSON result ``lightning_dp/examples/sst2_hf.py`` prints, written by its ``--results-file`` (with
the command that made it). The six runs of the table, from the repository root with ``LIGHTNING_DP_DATA`` set::

    C="--train-size 4000 --epochs 3 --batch-size 256 --grad-accum 1 --lr 3e-2 \\
       --cache-features /tmp/hfruns/sst2_minilm_mean_4000.pt"
    for S in 0 1 2; do
      OMP_NUM_THREADS=2 python -m lightning_dp.examples.sst2_hf $C --seed $S --dp-seed $S \\
        --results-file docs/bench/sst2_hf/dp.seed$S.json
      OMP_NUM_THREADS=2 python -m lightning_dp.examples.sst2_hf $C --seed $S --disable-dp \\
        --results-file docs/bench/sst2_hf/non-dp.seed$S.json
    done
    python bench/sst2_hf.py --render

The table sets each seed's DP and non-DP dev accuracy side by side, then their mean and sample standard deviation
(n - 1) over the seeds; below it the DP runs' privacy (noise multiplier, steps, epsilon spent; a value the runs do not
share is given as its range), the environment and the recorded commands, each prefixed with the thread count it ran
at (the accuracy may change with it: docs/recipes.md).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from records import mean_std, plural, replace_between_markers, value_range

from lightning_dp.utils.help_format import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "bench" / "sst2_hf"
PAGE = ROOT / "docs" / "hf.md"
START, END = "<!-- sst2_hf:start -->", "<!-- sst2_hf:end -->"
#: What the environment line states, in order: (key of ``environment``, label).
ENVIRONMENT = (("torch", "torch"), ("numpy", "numpy"), ("python", "Python"), ("device_name", "CPU"))


def load_records() -> list[dict[str, Any]]:
    """Every record in :data:`RECORDS`, in file-name order."""
    return [json.loads(path.read_text(encoding="utf-8")) for path in sorted(RECORDS.glob("*.json"))]


def _accuracy_cell(runs: list[dict[str, Any]], seed: int) -> str:
    values = [run["dev_accuracy"] for run in runs if run["seed"] == seed]
    if len(values) > 1:
        raise ValueError(f"more than one record of seed {seed} with dp={runs[0]['dp']}")
    return f"{100 * values[0]:.2f}%" if values else "-"


def _mean_cell(runs: list[dict[str, Any]], counted: bool) -> str:
    if not runs:
        return "-"
    mean, std = mean_std([100 * run["dev_accuracy"] for run in runs])
    return f"{mean:.2f} +- {std:.2f}%" + (f" ({plural(len(runs), 'seed')})" if counted else "")


def _noise(run: dict[str, Any]) -> dict[str, Any]:
    """``run`` with the noise on its averaged gradient: the per-coordinate standard deviation sigma C / (q N) (the
    noise is added to the clipped sum and divided by the expected batch q N) and that std times the square root of
    the trained parameters' count (about the noise vector's norm)."""
    std = run["noise_multiplier"] * run["max_grad_norm"] / (run["sample_rate"] * run["train_size"])
    return {**run, "noise_std": std, "noise_norm": std * math.sqrt(run["trained_params"])}


def markdown(records: list[dict[str, Any]]) -> str:
    """The section of docs/hf.md: the accuracy table, the difference of the means, the DP runs' privacy, the
    environment and the commands."""
    if not records:
        return "(no run recorded yet)"
    dp = [run for run in records if run["dp"]]
    plain = [run for run in records if not run["dp"]]
    seeds = sorted({run["seed"] for run in records})
    same_count = len(dp) == len(plain)
    label = f"mean +- std ({plural(len(dp), 'seed')})" if same_count else "mean +- std over the seeds"
    lines = [
        "| seed | DP dev accuracy | non-DP dev accuracy |",
        "|---|---|---|",
        *(f"| {seed} | {_accuracy_cell(dp, seed)} | {_accuracy_cell(plain, seed)} |" for seed in seeds),
        f"| {label} | {_mean_cell(dp, not same_count)} | {_mean_cell(plain, not same_count)} |",
        "",
        "std: the sample standard deviation over the seeds (n - 1).",
    ]
    if dp and plain:
        (dp_mean, dp_std), (plain_mean, plain_std) = (mean_std([r["dev_accuracy"] for r in rs]) for rs in (dp, plain))
        lines[-1] += (
            f" The DP mean minus the non-DP mean: {100 * (dp_mean - plain_mean):+.2f} points, against standard "
            f"deviations of {100 * dp_std:.2f} (DP) and {100 * plain_std:.2f} (non-DP) points."
        )
    first = records[0]
    lines += [
        "",
        f"Every run: the first {value_range(records, 'train_size')} training sentences, {first['trained']} trained "
        f"({value_range(records, 'trained_params', ',')} parameters, pooling `{first['pooling']}`), batch "
        f"{value_range(records, 'batch')}, {value_range(records, 'epochs')} epochs, learning rate "
        f"{value_range(records, 'lr')}; the majority class is {value_range(records, 'majority_class', '.1%')} of the "
        "dev sentences.",
    ]
    if dp:
        noisy = [_noise(run) for run in dp]
        lines[-1] += (
            f" All DP runs: sigma = {value_range(dp, 'noise_multiplier', '.3f')}, {value_range(dp, 'steps')} steps at "
            f"sample rate q = {value_range(dp, 'sample_rate')}, clipping bound C = {value_range(dp, 'max_grad_norm')} "
            f"({value_range(dp, 'clipping', '')} clipping), epsilon spent {value_range(dp, 'epsilon', '.2f')} at "
            f"delta = {value_range(dp, 'delta', '.3g')} ({value_range(dp, 'accountant', '')} accountant); the noise "
            f"on the averaged gradient has std sigma C / (q N) = {value_range(noisy, 'noise_std', '.2g')} per "
            f"coordinate, norm about {value_range(noisy, 'noise_norm', '.2f')} over the trained parameters."
        )
    environments = [run["environment"] for run in records]
    stated = ", ".join(f"{label} {value_range(environments, key, '')}" for key, label in ENVIRONMENT)
    threads = plural(value_range(environments, "threads"), "thread")
    lines += [
        "",
        f"Environment: {stated} ({value_range(environments, 'cpu_capability', '')} kernels), {threads}. Commands "
        "(from the repository root, with `LIGHTNING_DP_DATA` set; each writes its record):",
        "",
        "```bash",
        *(f"OMP_NUM_THREADS={run['environment']['threads']} {run['command']}" for run in records),
        "```",
    ]
    return "\n".join(lines)


def render() -> None:
    """Put :func:`markdown` of the records between the markers of docs/hf.md."""
    replace_between_markers(PAGE, markdown(load_records()), START, END)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--render", action="store_true", help="re-render docs/hf.md from the records")
    args = parser.parse_args()
    if not args.render:
        parser.error("the runs are recorded by the example's --results-file (see -h); --render renders them")
    render()


if __name__ == "__main__":
    main()
