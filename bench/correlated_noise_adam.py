"""Why banded noise does not beat DP-SGD on the SST-2 recipe, which trains with AdamW (docs/correlated_noise.md, "Why
SST-2 shows no gain"): the noise each step adds, and the recipe run again at a larger learning rate.

    python bench/correlated_noise_adam.py --seeds 0 --threads 1   # both runs of each seed (about 50 min each), render
    python bench/correlated_noise_adam.py --render                # only re-render from the records

Computed (the same command gives the same numbers) from the recipe's recorded seed-0 runs of DP-SGD and banded noise
(band 4) at epsilon 3 (``docs/recipes/sst2_full/``): the band's strategy as the run optimised it (``optimize_banded``
for prefix sums under the run's linearly decaying learning rate, one participation; checked against the run's largest
column norm ``s``), each run's ``sigma`` (the noise on ``C x`` in clip-norm units: DP-SGD's noise multiplier, the
band's multiplier times ``s``), and from them: the standard deviation of the noise one step adds, ``sigma ||row t of
C^-1||``, as a mean over the steps, over DP-SGD's; the same as the expected norm of the noise in the averaged gradient
(times ``sqrt(d) / B`` for ``d`` trained parameters and the expected batch ``B``); and the expected total squared
error of the iterates over DP-SGD's for the run's workload and for the same schedule with heavy-ball momentum 0.9
(AdamW's ``beta1``). Adam divides each coordinate's step by the root of its second-moment estimate: where the noise
dominates that estimate, the step is about the learning rate whatever the noise's size, and the signal's share of it
shrinks in proportion to the noise's standard deviation per step.

Measured: the recipe's docs configuration (``bench/recipes.py``'s variants ``gaussian-eps3`` and ``banded-eps3``,
seeds as given) at ``--learning-rate`` (default 0.006: the recipe's 0.002 times 3, the ratio of the noise per step
rounded; the new head's own rate unchanged), each run in its own process, DP-SGD then banded for every seed, recorded
in ``docs/recipes/sst2_full/learning_rate/<variant>.lr<LR>[.seed<S>].json`` and rendered beside the
recipe's own records of the same variants and seeds, with the median norm of the noised gradient their steps logged.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

import recipe_runs
from records import replace_between_markers

from lightning_dp.utils.help_format import HelpFormatter
from recipes import ROOT, load_results, results_name, run_variant

TASK = "sst2_full"
PAGE = ROOT / "docs" / "correlated_noise.md"
RECORDS = ROOT / "docs" / "recipes" / TASK / "learning_rate"
ADAM_BETA1 = 0.9
VARIANTS = {"gaussian-eps3": "DP-SGD", "banded-eps3": "banded, b = 4"}
NOISE_MARKERS = ("<!-- adam-noise:start -->", "<!-- adam-noise:end -->")
RUN_MARKERS = ("<!-- adam-runs:start -->", "<!-- adam-runs:end -->")


def base_runs() -> dict[str, list[dict[str, Any]]]:
    """The recipe's own recorded runs of :data:`VARIANTS` (``bench/recipes.py``), seed 0 first."""
    recorded = load_results(TASK)
    return {variant: recorded[variant] for variant in VARIANTS}


def noise_per_step(dp_sgd: dict[str, Any], banded: dict[str, Any]) -> dict[str, float]:
    """The computed comparison of the module docstring for two recorded runs (their ``results.json``):
    ``sigma_dp_sgd``, ``sigma_banded``, ``column_norm`` (the band's ``s``), ``step_std_ratio`` (banded over DP-SGD,
    the mean over the steps), ``noise_norm_dp_sgd`` and ``noise_norm_banded`` (clip-norm units), ``error_ratio`` (the
    run's workload) and ``error_ratio_momentum`` (with AdamW's ``beta1``).

    Raises:
        ValueError: a run not on HF's linear schedule without warm-up, or a strategy optimised here that is not the
            run's (another largest column norm).
    """
    import numpy as np

    from lightning_dp.accounting.banded_mf import band_and_max_column_norm
    from lightning_dp.correlated_noise.optimize import optimize_banded, strategy_error
    from lightning_dp.correlated_noise.workloads import Workload

    training, privacy = banded["arguments"]["training"], banded["privacy"]
    if training["lr_scheduler_type"] != "linear" or training["warmup_steps"]:
        raise ValueError("the computation follows HF's linear schedule without warm-up")
    steps, rate = privacy["steps"], training["learning_rate"]
    rates = [rate * (1 - t / steps) for t in range(steps)]
    workload, momentum = Workload.with_schedule(rates), Workload.with_schedule(rates, ADAM_BETA1)
    strategy = optimize_banded(steps, privacy["correlation_band"], max_participations=1, workload=workload)
    column_norm = band_and_max_column_norm(strategy, steps)[1]
    if not math.isclose(column_norm, privacy["max_column_norm"], rel_tol=1e-6):
        raise ValueError(f"the strategy's column norm is {column_norm}, the run's {privacy['max_column_norm']}")
    sigma_dp_sgd, sigma_banded = dp_sgd["privacy"]["noise_multiplier"], privacy["noise_multiplier"] * column_norm
    rows = np.sqrt((strategy.inverse_dense(steps) ** 2).sum(axis=1))  # ||row t of C^-1||; DP-SGD's are all 1
    identity = optimize_banded(steps, 1)
    ratio = float(sigma_banded * rows.mean() / sigma_dp_sgd)
    norm = math.sqrt(banded["trainable_params"]) / banded["expected_batch"] * privacy["max_grad_norm"]
    variance = (sigma_banded / sigma_dp_sgd) ** 2
    return {
        "sigma_dp_sgd": sigma_dp_sgd,
        "sigma_banded": sigma_banded,
        "column_norm": column_norm,
        "step_std_ratio": ratio,
        "noise_norm_dp_sgd": sigma_dp_sgd * norm,
        "noise_norm_banded": sigma_dp_sgd * ratio * norm,
        "error_ratio": variance * strategy_error(strategy, workload) / strategy_error(identity, workload),
        "error_ratio_momentum": variance * strategy_error(strategy, momentum) / strategy_error(identity, momentum),
    }


def recorded_noise() -> dict[str, float]:
    """:func:`noise_per_step` of the recipe's seed-0 runs (:func:`base_runs`)."""
    return noise_per_step(*(runs[0] for runs in base_runs().values()))


def noise_markdown(numbers: dict[str, float]) -> str:
    """The computed table (:func:`recorded_noise`), with its command."""
    return "\n".join(
        [
            "```bash",
            "python bench/correlated_noise_adam.py --render",
            "```",
            "",
            "| noise | sigma (the noise on C x) | noise std per step / DP-SGD's (mean over the steps) | the noise's "
            "norm in the averaged gradient (mean) | iterates' squared error / DP-SGD's (the run's workload) | the "
            "same with momentum 0.9 |",
            "|---|---|---|---|---|---|",
            f"| DP-SGD | {numbers['sigma_dp_sgd']:.4f} | 1 | {numbers['noise_norm_dp_sgd']:.3f} | 1 | 1 |",
            f"| banded, b = 4, optimised for the run's schedule (s = {numbers['column_norm']:.3f}) | "
            f"{numbers['sigma_banded']:.4f} = noise multiplier x s | "
            f"{numbers['step_std_ratio']:.2f} | {numbers['noise_norm_banded']:.3f} | {numbers['error_ratio']:.2f} | "
            f"{numbers['error_ratio_momentum']:.2f} |",
        ]
    )


def record_path(variant: str, learning_rate: float, seed: int) -> Path:
    """Where the run of ``variant`` at ``learning_rate`` with ``seed`` is kept."""
    return RECORDS / results_name(f"{variant}.lr{learning_rate:g}", seed)


def run(learning_rate: float, seeds: list[int], threads: int | None) -> None:
    """Run both variants of every seed at ``learning_rate`` (DP-SGD first), each in its own process."""
    if learning_rate == base_rate(base_runs()):
        raise ValueError(f"{learning_rate:g} is the recipe's own rate, whose runs bench/recipes.py keeps")
    RECORDS.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        for variant in VARIANTS:
            results = record_path(variant, learning_rate, seed)
            run_variant(TASK, variant, seed, results, threads, ["--learning_rate", f"{learning_rate:g}"])


def base_rate(base: dict[str, list[dict[str, Any]]]) -> float:
    """The learning rate of the recipe's own runs ``base`` (:func:`base_runs`)."""
    return next(iter(base.values()))[0]["arguments"]["training"]["learning_rate"]


def load_runs() -> dict[float, dict[str, list[dict[str, Any]]]]:
    """``learning rate -> variant -> runs`` (by seed) of the records, with the recipe's own runs (:func:`base_runs`)
    of the seeds recorded at another rate.

    Raises:
        ValueError: a record at the recipe's own rate.
    """
    base = base_runs()
    rate = base_rate(base)
    runs: dict[float, dict[str, list[dict[str, Any]]]] = {}
    for path in sorted(RECORDS.glob("*.json")):
        result = json.loads(path.read_text())
        if result["arguments"]["training"]["learning_rate"] == rate:
            raise ValueError(f"{path} is at the recipe's own rate {rate:g}: bench/recipes.py keeps those runs")
        variant = path.name.split(".lr", 1)[0]
        runs.setdefault(result["arguments"]["training"]["learning_rate"], {}).setdefault(variant, []).append(result)
    seeds = {
        run["arguments"]["training"]["seed"] for by_variant in runs.values() for r in by_variant.values() for run in r
    }
    runs[rate] = {
        variant: [run for run in variant_runs if run["arguments"]["training"]["seed"] in seeds]
        for variant, variant_runs in base.items()
    }
    for by_variant in runs.values():
        for variant_runs in by_variant.values():
            variant_runs.sort(key=lambda run: run["arguments"]["training"]["seed"])
    return runs


def gradient_norm(runs: list[dict[str, Any]]) -> float:
    """The median over the runs' logged steps of the norm of the averaged noised gradient the optimizer got (HF's
    ``grad_norm``)."""
    return statistics.median(entry["grad_norm"] for run in runs for entry in run["history"] if "grad_norm" in entry)


def runs_markdown(runs: dict[float, dict[str, list[dict[str, Any]]]]) -> str:
    """One row per learning rate and variant: accuracy per seed, mean +- std, the noised gradient's norm
    (:func:`gradient_norm`), epsilon, and the commands."""
    if len(runs) < 2:
        return "(no run recorded yet)"
    every = [run for by_variant in runs.values() for variant_runs in by_variant.values() for run in variant_runs]
    settings = {
        name: ", ".join(sorted({f"{value:g}" for value in values}))
        for name, values in (
            ("steps", [run["privacy"]["steps"] for run in every]),
            ("epsilon", [run["arguments"]["privacy"]["target_epsilon"] for run in every]),
            ("head", [run["arguments"]["recipe"]["head_learning_rate"] for run in every]),
        )
    }
    lines = [
        f"**{TASK}** (accuracy in percent on the evaluation split, {settings['steps']} steps, target epsilon "
        f"{settings['epsilon']}; the new head's learning rate {settings['head']} in every run)",
        "",
        "| learning rate | noise | accuracy per seed | accuracy (mean +- std) | noised gradient's norm | epsilon | "
        "CPU (threads) |",
        "|---|---|---|---|---|---|---|",
    ]
    shown: dict[str, list[dict[str, Any]]] = {}
    for rate in sorted(runs):
        for variant, name in VARIANTS.items():
            variant_runs = runs[rate].get(variant, [])
            if not variant_runs:
                continue
            row = recipe_runs.summary(TASK, variant_runs)
            per_seed = ", ".join(
                f"{run['metrics']['accuracy']:.2f} (seed {run['arguments']['training']['seed']})"
                for run in variant_runs
            )
            lines.append(
                f"| {rate:g} | {name} | {per_seed} | {row['metric']} | {gradient_norm(variant_runs):.3f} | "
                f"{row['epsilon']} | {row['machines']} |"
            )
            shown[f"{variant} {rate:g}"] = variant_runs
    return "\n".join([*lines, "", *recipe_runs.commands(TASK, shown)])


def render() -> None:
    replace_between_markers(PAGE, noise_markdown(recorded_noise()), *NOISE_MARKERS)
    replace_between_markers(PAGE, runs_markdown(load_runs()), *RUN_MARKERS)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--learning-rate", type=float, default=0.006, help="the runs' learning rate (default 0.006)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS of the runs (default: torch's default)")
    parser.add_argument("--render", action="store_true", help="only re-render the page from the records")
    args = parser.parse_args(argv)
    if not args.render:
        run(args.learning_rate, args.seeds, args.threads)
    render()
    print(noise_markdown(recorded_noise()), runs_markdown(load_runs()), sep="\n\n", file=sys.stdout)


if __name__ == "__main__":
    main()
