"""DP-SGD against banded and BLT matrix-factorization noise on a recipe's docs configuration, at several target
epsilons (docs/correlated_noise.md, "Measured: the recipes").

    python bench/correlated_noise_recipes.py --task cifar --record cifar   # 27 runs (about 30 s each idle), render
    python bench/correlated_noise_recipes.py --render                      # only re-render from the records
    python bench/recipes.py --task sst2_full --variants banded-eps3 blt-eps3 --seeds 0 --threads 1   # SST-2 runs

For every seed, every target epsilon and every noise in turn (interleaved), one run of the recipe's docs
configuration through the script users run, as ``bench/recipes.py`` runs its variants (each in its own process):
``gaussian-eps<E>`` (DP-SGD, the ``pld`` accountant), ``banded-eps<E>`` (``noise_correlation="banded"``, band 4:
cyclic Poisson sampling over 4 groups at rate ``4 q``, ``banded-mf``) and ``blt-eps<E>`` (``noise_correlation="blt"``,
4 buffers: ``floor(1 / q)`` cyclic groups, ``blt-minsep``, no amplification credited), each calibrated for ``E`` by
its own accountant over the configuration's steps, with the seed given to the model's and the DP generators' seeds.
Reported per noise and epsilon: the task's metric (mean and sample standard deviation over the seeds), the epsilon
the runs report and their noise multiplier. A record keeps every run's numbers.

A run of SST-2 on the full data takes about 40 minutes on a CPU, too long for all 27 in one invocation: its table
comes from ``bench/recipes.py``'s records of the same variants (``docs/recipes/sst2_full/``, one file per variant and
seed), which accumulate a variant and a seed at a time, and shows what is recorded, with each row's number of seeds
and the CPUs the runs took.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import recipe_runs
import torch
from records import (
    add_record_options,
    mean_std,
    plural,
    render_records,
    replace_between_markers,
    run_or_render,
    value_range,
)

from lightning_dp.utils.help_format import HelpFormatter
from recipes import TASKS, load_results, variant_command

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "bench" / "correlated_noise_recipes"
PAGE = ROOT / "docs" / "correlated_noise.md"
START, END = "<!-- recipes:start -->", "<!-- recipes:end -->"
#: the noises compared (``bench/recipes.py`` variants ``<noise>-eps<E>``) and how the table names them.
NOISES = {"gaussian": "DP-SGD", "banded": "banded, b = 4", "blt": "BLT, d = 4"}
#: the target epsilons compared.
EPSILONS = (1.0, 3.0, 8.0)
#: the recipes whose table comes from ``bench/recipes.py``'s records -> the markers of the table.
FROM_RECIPE_RECORDS = {"sst2_full": ("<!-- recipes-sst2:start -->", "<!-- recipes-sst2:end -->")}


def run_once(task: str, variant: str, seed: int, threads: int | None) -> dict[str, Any]:
    """One run of ``variant`` of ``task`` with ``seed`` in its own process: its recipe results (``results.json``)."""
    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory() as folder:
        results = Path(folder) / "results.json"
        command = variant_command(task, variant, str(results), folder, seed)
        subprocess.run(command, cwd=ROOT, check=True, env=env, stdout=subprocess.DEVNULL)
        return json.loads(results.read_text(encoding="utf-8"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every seed, epsilon and noise in turn: one row per run (noise, target epsilon, seed, metric, the epsilon and
    noise multiplier it reports, its steps and training time)."""
    metric = TASKS[args.task][2]
    runs = []
    for seed in args.seeds:
        for epsilon in args.epsilons:
            for noise in NOISES:
                result = run_once(args.task, f"{noise}-eps{epsilon:g}", seed, args.threads)
                privacy = result["privacy"]
                runs.append(
                    {
                        "noise": noise,
                        "target_epsilon": epsilon,
                        "seed": seed,
                        "metric": result["metrics"][metric],
                        "epsilon": privacy["epsilon"],
                        "noise_multiplier": privacy["noise_multiplier"],
                        "accountant": privacy["accountant"],
                        "steps": result["steps"],
                        "train_seconds": result["train_seconds"],
                    }
                )
                print(json.dumps(runs[-1]), flush=True)
    return {"task": args.task, "metric": metric, "threads": args.threads or torch.get_num_threads(), "runs": runs}


def rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target epsilon and noise: the metric's mean and std over the seeds, the epsilons and noise
    multipliers the runs report (their range), the accountant."""
    out = []
    for epsilon in record["args"]["epsilons"]:
        for noise in NOISES:
            runs = [r for r in record["runs"] if r["noise"] == noise and r["target_epsilon"] == epsilon]
            if not runs:
                continue
            mean, std = mean_std([r["metric"] for r in runs])
            out.append(
                {
                    "target_epsilon": epsilon,
                    "noise": noise,
                    "mean": mean,
                    "std": std,
                    "seeds": len(runs),
                    "epsilon": value_range(runs, "epsilon", ".3f"),
                    "noise_multiplier": value_range(runs, "noise_multiplier", ".4g"),
                    "accountant": runs[0]["accountant"],
                }
            )
    return out


def markdown(record: dict[str, Any]) -> str:
    """The record's table, with its command and environment above it."""
    env, first = record["environment"], record["runs"][0]
    seeds = record["args"]["seeds"]
    lines = [
        f"**{record['task']}** ({record['metric']} in percent on the evaluation split, {plural(len(seeds), 'seed')} "
        f"{seeds}, {first['steps']} steps; torch {env['torch']}, {env.get('device_name', 'CPU')}, "
        f"{plural(record['threads'], 'thread')} per run)",
        "",
        "```bash",
        record["command"],
        "```",
        "",
        f"| target epsilon | noise | {record['metric']} (mean +- std) | epsilon | noise multiplier | accountant |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows(record):
        lines.append(
            f"| {row['target_epsilon']:g} | {NOISES[row['noise']]} | {row['mean']:.2f} +- {row['std']:.2f} | "
            f"{row['epsilon']} | {row['noise_multiplier']} | `{row['accountant']}` |"
        )
    return "\n".join(lines)


def recipe_records_markdown(task: str, results: dict[str, list[dict[str, Any]]]) -> str:
    """The table of ``task`` from ``bench/recipes.py``'s records (``results``, its ``load_results``): one row per
    target epsilon and noise recorded, over the seeds recorded, and the commands of the runs."""
    shown = recipe_runs.compared(results, [f"{noise}-eps{epsilon:g}" for epsilon in EPSILONS for noise in NOISES])
    if not shown:
        return "(no run recorded yet)"
    first = next(iter(shown.values()))[0]
    metric = TASKS[task][2]
    lines = [
        f"**{task}** ({metric} in percent on the evaluation split, {first['steps']} steps; torch "
        f"{first['environment']['torch']}; bench/recipes.py's records, docs/recipes/{task}/)",
        "",
        f"| target epsilon | noise | {metric} (mean +- std) | seeds | epsilon | noise multiplier | accountant | CPU "
        "(threads) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for variant, runs in shown.items():
        noise, epsilon = variant.split("-eps")
        row = recipe_runs.summary(task, runs)
        lines.append(
            f"| {epsilon} | {NOISES[noise]} | {row['metric']} | {row['seeds']} | "
            f"{row['epsilon']} | {row['noise_multiplier']} | `{row['accountant']}` | {row['machines']} |"
        )
    return "\n".join([*lines, "", *recipe_runs.commands(task, shown)])


def render() -> None:
    render_records(RECORDS, markdown, PAGE, START, END)
    for task, (start, end) in FROM_RECIPE_RECORDS.items():
        replace_between_markers(PAGE, recipe_records_markdown(task, load_results(task)), start, end)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--task", choices=sorted(TASKS), default="cifar", help="the recipe (default cifar)")
    parser.add_argument("--epsilons", nargs="+", type=float, default=list(EPSILONS), help="target epsilons")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS of the runs (default: torch's default)")
    add_record_options(parser, RECORDS)
    run_or_render(
        parser.parse_args(),
        run,
        render,
        script="bench/correlated_noise_recipes.py",
        records=RECORDS,
        report_lines=lambda record: [json.dumps(row) for row in rows(record)],
    )


if __name__ == "__main__":
    main()
