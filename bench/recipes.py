"""Run the recipes' documented variants and render their result tables into the docs.

    nice -n 15 python bench/recipes.py --task glue          # the five variants of one recipe, then render
    nice -n 15 python bench/recipes.py --task glue --seeds 1 2   # the same with other seeds
    nice -n 15 python bench/recipes.py --task glue --variants untuned   # the pretrained model, no training step
    nice -n 15 python bench/recipes.py --task cifar --variants gaussian-eps3 --seeds 0 1 2 --threads 1
    python bench/recipes.py --render                        # only re-render the docs from docs/recipes/*/*.json

Each variant runs the recipe's docs configuration unchanged plus the variant's flags, through the same script users
run (``python recipes/<task>.py --config configs/<name>_offline.yaml ...``), one process after another (each in its
own process, so no state is shared), and keeps the run's ``results.json`` as ``docs/recipes/<task>/<variant>.json``
(seed 0, the configurations' own) or ``<variant>.seed<S>.json`` (seed S, given to the model's and the DP
generators' seeds by flags). A variant recorded with several seeds is rendered as the mean and the sample standard
deviation over them. The ``untuned`` variant of an HF recipe (the baseline row: ``--dp false --max_steps -1
--num_train_epochs 0``, so the Trainer takes no step) evaluates the model as loaded, LoRA adapters and new heads at
their initialisation.
The offline configurations read the full local copies of the data from the data root ``LIGHTNING_DP_DATA`` (set it
first; docs/recipes.md, "Local data").
Rendering puts one table per task between the ``<!-- results -->`` markers of ``docs/recipes/<task>.md`` and the
summary table between those of ``docs/recipes.md``; the tables hold only what the JSON files say. A task whose runs
recorded periodic evaluations (their ``history``) also gets ``docs/recipes/<task>/curves.png``: the evaluation metric
and epsilon against the optimizer steps.

``--threads N`` runs the variants with ``OMP_NUM_THREADS=N`` (torch's intra-op threads) and keeps them apart, as
``<variant>.threads<N>.json`` / ``<variant>.threads<N>.seed<S>.json``: they are not part of the results tables but of
the thread-count table between the ``<!-- threads -->`` markers of the task's page (where the page has them), which
sets each seed's metric at N threads beside the same seed's recorded run (the machine's default thread count).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from records import mean_std, replace_between_markers

from lightning_dp.utils.help_format import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
START, END = "<!-- results:start -->", "<!-- results:end -->"
THREADS_START, THREADS_END = "<!-- threads:start -->", "<!-- threads:end -->"

#: task -> (script users run, docs configuration, metric of the summary table).
TASKS = {
    "glue": ("recipes/glue.py", "configs/glue_offline.yaml", "accuracy"),
    "sst2_full": ("recipes/glue.py", "configs/glue_sst2_full_offline.yaml", "accuracy"),
    "e2e_dart": ("recipes/e2e_dart.py", "configs/e2e_dart_offline.yaml", "bleu"),
    "e2e_full": ("recipes/e2e_dart.py", "configs/e2e_full_offline.yaml", "bleu"),
    "billsum": ("recipes/billsum.py", "configs/billsum_offline.yaml", "rougeL"),
    "hotpotqa": ("recipes/hotpotqa.py", "configs/hotpotqa_offline.yaml", "f1"),
    "cifar": ("recipes/cifar.py", "configs/cifar10_offline.yaml", "accuracy"),
}
#: The periodic evaluation a task's curves show where it is not ``eval_<metric>``: the generation recipes evaluate
#: their loss during training (a decoding per evaluation would cost far more) and decode only at the end.
CURVE_KEYS = {"e2e_full": ("eval_loss", "loss on the evaluation split")}
NOISE_PARAMETERS = ("noise_multiplier", "noise_scale", "gamma_shape", "gamma_scale")
VARIANTS = ("non-private", "gaussian-eps3", "gaussian-eps8", "lap2-eps3", "lap2-eps8")
#: Variants that change the clipping or the noise's correlation (not run by default), each with Gaussian noise
#: calibrated for its ``-eps<E>`` budget: name -> the privacy options it sets (``PrivacyArguments`` / ``DPStrategy``
#: names). Automatic clipping (Bu et al. 2023, Section 4) at the configuration's ``C``; adaptive clipping (Andrew et al.
#: 2021) towards the median, started from the configuration's ``C``; banded MF noise with band 4 and BLT noise with 4
#: buffers (docs/correlated_noise.md), the strategy optimised for the run's steps.
OPTION_VARIANTS: dict[str, dict[str, object]] = {
    "automatic": {"clipping_fn": "automatic"},
    "adaptive": {"target_unclipped_quantile": 0.5},
    "banded": {"noise_correlation": "banded", "correlation_band": 4},
    "blt": {"noise_correlation": "blt", "correlation_buffers": 4},
}
#: The epsilons of the option variants and of DP-SGD beyond the defaults.
OPTION_EPSILONS = (1, 3, 8)
EXTRA_VARIANTS = (
    "gaussian-eps1",
    *(f"{name}-eps{epsilon}" for name in OPTION_VARIANTS for epsilon in OPTION_EPSILONS),
)
#: The baseline of the HF recipes: the pretrained model evaluated without any training step (not run by default;
#: rendered first where recorded). The CIFAR-10 recipe trains from scratch and has none.
UNTUNED = "untuned"
#: The variants of the summary table of docs/recipes.md, in the order shown.
SUMMARY_VARIANTS = (UNTUNED, *VARIANTS)
#: Every variant a task's table may show, in the order shown.
ALL_VARIANTS = (*SUMMARY_VARIANTS, *EXTRA_VARIANTS)


def hf_variant_flags(variant: str, results_file: str) -> list[str]:
    """The flags of ``variant`` for an HF recipe (``RecipeArguments`` / ``PrivacyArguments`` fields)."""
    flags = ["--results_file", results_file]
    if variant == UNTUNED:  # zero epochs: the Trainer takes no step, the recipe evaluates the model it was given
        return [*flags, "--dp", "false", "--max_steps", "-1", "--num_train_epochs", "0"]
    if variant == "non-private":
        return [*flags, "--dp", "false"]
    noise, epsilon, options = variant_options(variant)
    extra = [text for name, value in options.items() for text in (f"--{name}", str(value))]
    return [*flags, "--dp", "true", "--noise", noise, "--target_epsilon", epsilon, *extra]


def variant_options(variant: str) -> tuple[str, str, dict[str, object]]:
    """``(noise, epsilon, privacy options)`` of a DP variant ``<noise or option variant>-eps<E>``: an option variant
    (:data:`OPTION_VARIANTS`) is Gaussian noise with its options."""
    name, epsilon = variant.split("-eps")
    if name in OPTION_VARIANTS:
        return "gaussian", epsilon, OPTION_VARIANTS[name]
    return name, epsilon, {}


def cifar_variant_flags(variant: str, results_file: str) -> list[str]:
    """The flags of ``variant`` for the CIFAR-10 recipe: the recipe's own documented runs, or Gaussian noise at the
    variant's budget with the DP strategy's further options."""
    cifar = importlib.import_module("lightning_dp.recipes.cifar")
    if variant in cifar.VARIANTS:
        return cifar.variant_flags(variant, results_file)
    noise, epsilon, options = variant_options(variant)
    base = cifar.variant_flags(f"{noise}-eps{epsilon}", results_file)
    return [*base, *(f"--trainer.strategy.init_args.{name}={value}" for name, value in options.items())]


def seed_flags(task: str, variant: str, seed: int) -> list[str]:
    """The flags that run ``variant`` of ``task`` with ``seed`` instead of the configuration's 0: the model's (and
    data order's) seed and the DP generators' seed; none for seed 0."""
    if seed == 0:
        return []
    if task == "cifar":
        dp = [] if variant == "non-private" else [f"--trainer.strategy.init_args.seed={seed}"]
        return [f"--seed_everything={seed}", *dp]
    return ["--seed", str(seed), "--dp_seed", str(seed)]


def results_name(variant: str, seed: int, threads: int | None = None) -> str:
    """The JSON file a run of ``variant`` with ``seed`` is kept in (with ``threads``: a run at that thread count)."""
    stem = variant if threads is None else f"{variant}.threads{threads}"
    return f"{stem}.json" if seed == 0 else f"{stem}.seed{seed}.json"


def variant_command(task: str, variant: str, results_file: str, output_dir: str, seed: int = 0) -> list[str]:
    """The command line that runs ``variant`` of ``task``'s docs configuration with ``seed``."""
    script, config, _ = TASKS[task]
    command = [sys.executable, script, "--config", config]
    if task == "cifar":
        if variant == UNTUNED:
            raise ValueError("the CIFAR-10 recipe trains from scratch: it has no untuned baseline")
        return [*command, *cifar_variant_flags(variant, results_file), *seed_flags(task, variant, seed)]
    flags = [*hf_variant_flags(variant, results_file), *seed_flags(task, variant, seed)]
    return [*command, *flags, "--output_dir", output_dir]


def run_variant(
    task: str, variant: str, seed: int, results: Path, threads: int | None = None, flags: Sequence[str] = ()
) -> None:
    """Run ``variant`` of ``task`` with ``seed`` and the further recipe ``flags`` in its own process (at ``threads``
    threads when given), its ``results.json`` kept as ``results`` (a path under the repository); the command is printed
    as it runs."""
    env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with tempfile.TemporaryDirectory() as output_dir:
        command = [*variant_command(task, variant, str(results.relative_to(ROOT)), output_dir, seed), *flags]
        prefix = [] if threads is None else [f"OMP_NUM_THREADS={threads}"]
        print("$", *prefix, shlex.join(command), flush=True)
        subprocess.run(command, cwd=ROOT, check=True, env=env)


def run_task(task: str, variants: list[str], seeds: list[int], threads: int | None = None) -> None:
    folder = DOCS / "recipes" / task
    folder.mkdir(parents=True, exist_ok=True)
    for seed in seeds:
        for variant in variants:
            run_variant(task, variant, seed, folder / results_name(variant, seed, threads), threads)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _noise_text(privacy: dict | None) -> str:
    if privacy is None:
        return "none"
    inner = ", ".join(f"{k}={privacy[k]:.4g}" for k in NOISE_PARAMETERS if k in privacy)
    return f"{privacy['noise']} ({inner})"


def load_results(task: str) -> dict[str, list[dict]]:
    """``variant -> [results.json of each seed]`` of ``task`` (seed 0 first, then by seed) for the variants that
    have run with seed 0."""
    folder = DOCS / "recipes" / task
    results = {}
    for variant in ALL_VARIANTS:
        if (folder / f"{variant}.json").exists():
            seeds = sorted(folder.glob(f"{variant}.seed*.json"), key=lambda path: int(path.stem.split(".seed")[1]))
            results[variant] = [json.loads(path.read_text()) for path in [folder / f"{variant}.json", *seeds]]
    return results


def load_thread_runs(task: str) -> dict[tuple[str, int], dict[int, dict]]:
    """``(variant, threads) -> {seed: results.json}`` of ``task``'s runs made with ``--threads``."""
    runs: dict[tuple[str, int], dict[int, dict]] = {}
    for path in sorted((DOCS / "recipes" / task).glob("*.threads*.json")):
        variant, rest = path.stem.split(".threads", 1)
        threads, _, seed = rest.partition(".seed")
        runs.setdefault((variant, int(threads)), {})[int(seed or 0)] = json.loads(path.read_text())
    return runs


def _spread(values: list[float | None], digits: int = 2) -> str:
    """One value as it is; several as ``mean +- sample std (n)``."""
    if any(value is None for value in values):
        return "-"
    if len(values) == 1:
        return _fmt(values[0], digits)
    mean, std = mean_std(values)
    return f"{mean:.{digits}f} +- {std:.{digits}f} ({len(values)})"


def display_command(task: str, command: str) -> str:
    """The recorded command as a user types it from the repository root: ``python recipes/<task>.py ARGS``, without
    the temporary ``--output_dir`` the variant ran with."""
    args = shlex.split(command)
    args = args[args.index("--config") :] if "--config" in args else args[1:]
    kept: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--output_dir":
            skip = True
        else:
            kept.append(arg)
    return shlex.join(["python", TASKS[task][0], *kept])


def task_table(task: str, results: dict[str, list[dict]]) -> str:
    """The Markdown table (and commands) of one task's variants: each metric and time as one seed's value, or as
    the mean and spread over the seeds recorded (the privacy columns are the same for every seed)."""
    if not results:
        return "(no runs recorded yet)"
    keys = list(next(iter(results.values()))[0]["metrics"])
    head = ["variant", *keys, "epsilon spent", "delta", "noise", "clip C", "steps", "batch", "train s", "eval s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant, runs in results.items():
        result = runs[0]
        privacy = result.get("privacy")
        row = [
            variant,
            *(_spread([run["metrics"].get(k) for run in runs]) for k in keys),
            _fmt(privacy and privacy["epsilon"], 3),
            "-" if privacy is None else f"{privacy['delta']:.3g}",
            _noise_text(privacy),
            "-" if privacy is None else f"{privacy['max_grad_norm']:g}",
            str(result["steps"]),
            str(result["expected_batch"]),
            _fmt(statistics.mean(run["train_seconds"] for run in runs), 0),
            _fmt(statistics.mean(run["eval_seconds"] for run in runs), 0),
        ]
        lines.append("| " + " | ".join(row) + " |")
    sizes = next(iter(results.values()))[0]
    lines += [
        "",
        f"Training examples: {sizes['train_size']}; evaluation examples: {sizes['eval_size']}; trainable parameters: "
        f"{sizes['trainable_params']:,}; processes: {sizes['world_size']}. Scores in percent. Commands (from the "
        "repository root):",
        "",
        "```bash",
        *(display_command(task, run["command"]) for runs in results.values() for run in runs),
        "```",
    ]
    return "\n".join(lines)


def thread_table(task: str, thread_runs: dict[tuple[str, int], dict[int, dict]]) -> str:
    """The Markdown table of ``task``'s runs at another thread count: per seed, the summary metric of the recorded
    run of the same variant and seed (its thread count from its environment) and of the run at the other thread
    count, and their difference."""
    metric = TASKS[task][2]
    lines = [
        f"| variant | seed | {metric}, recorded run (threads) | {metric}, other thread count (threads) | difference |",
        "|---|---|---|---|---|",
    ]
    differences, commands = [], []
    for (variant, _), by_seed in sorted(thread_runs.items()):
        for seed, run in sorted(by_seed.items()):
            recorded = DOCS / "recipes" / task / results_name(variant, seed)
            if not recorded.exists():
                continue
            base = json.loads(recorded.read_text())
            difference = run["metrics"][metric] - base["metrics"][metric]
            differences.append(abs(difference))
            lines.append(
                f"| {variant} | {seed} | {base['metrics'][metric]:.2f} ({base['environment']['threads']}) | "
                f"{run['metrics'][metric]:.2f} ({run['environment']['threads']}) | {difference:+.2f} |"
            )
            commands.append(f"OMP_NUM_THREADS={run['environment']['threads']} {display_command(task, run['command'])}")
    if not differences:
        return "(no runs at another thread count recorded yet)"
    return "\n".join(
        [
            *lines,
            "",
            f"Mean absolute difference: {statistics.mean(differences):.2f} points over {len(differences)} runs.",
            "Commands (from the repository root):",
            "",
            "```bash",
            *commands,
            "```",
        ]
    )


def summary_table() -> str:
    """One row per task: its headline metric in every variant."""
    head = ["recipe", "metric", *SUMMARY_VARIANTS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for task in TASKS:
        results = load_results(task)
        if not results:
            lines.append(f"| [{task}](recipes/{task}.md) | (not run) |" + " - |" * len(SUMMARY_VARIANTS))
            continue
        metric = TASKS[task][2]
        cells = []
        for variant in SUMMARY_VARIANTS:
            runs = results.get(variant)
            if runs is None:
                cells.append("-")
                continue
            score = _spread([run["metrics"][metric] for run in runs])
            privacy = runs[0].get("privacy")
            cells.append(score if privacy is None else f"{score} (eps {privacy['epsilon']:.2f})")
        lines.append(f"| [{task}](recipes/{task}.md) | {metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def history_curves(runs: list[dict], key: str) -> list[tuple[list[int], list[float]]]:
    """``(steps, values)`` of ``key`` in each run's recorded log rows (runs recorded without them give none)."""
    curves = []
    for run in runs:
        by_step = {row["step"]: row[key] for row in run.get("history", []) if key in row and "step" in row}
        if by_step:  # one value per step (a step's log row and its evaluation row both carry epsilon)
            steps = sorted(by_step)
            curves.append((steps, [by_step[step] for step in steps]))
    return curves


def write_curves(task: str, results: dict[str, list[dict]]) -> Path | None:
    """``docs/recipes/<task>/curves.png``: the evaluation metric (``eval_<metric>`` of the periodic evaluations, or
    the task's :data:`CURVE_KEYS` entry) and epsilon against the optimizer steps, one line per variant and seed, with
    the majority-class score as a dotted line when the runs record it; ``None`` (nothing written) when no run
    recorded periodic evaluations."""
    metric, label = CURVE_KEYS.get(task, (f"eval_{TASKS[task][2]}", f"{TASKS[task][2]} on the evaluation split (%)"))
    if not any(history_curves(runs, metric) for runs in results.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (score, privacy) = plt.subplots(1, 2, figsize=(10, 3.8))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for number, (variant, runs) in enumerate(results.items()):
        colour = colours[number % len(colours)]
        for index, (steps, values) in enumerate(history_curves(runs, metric)):
            score.plot(steps, values, marker=".", color=colour, label=variant if index == 0 else None)
        for index, (steps, values) in enumerate(history_curves(runs, "epsilon")):
            privacy.plot(steps, values, color=colour, label=variant if index == 0 else None)
    majority = next(iter(results.values()))[0].get("majority_class_accuracy")
    if majority is not None:
        score.axhline(majority, color="grey", linestyle=":", label="majority class")
    score.set(xlabel="optimizer step", ylabel=label)
    privacy.set(xlabel="optimizer step", ylabel="epsilon spent", ylim=(0, None))
    for axes in (score, privacy):
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
    fig.suptitle(f"{task}: one line per variant and seed (docs/recipes/{task}/*.json)", fontsize=10)
    fig.tight_layout()
    path = DOCS / "recipes" / task / "curves.png"
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return path


def render(tasks: list[str]) -> None:
    """Re-render the tables of ``tasks``' pages, their curves (when the runs recorded periodic evaluations) and the
    summary table of docs/recipes.md."""
    for task in tasks:
        page = DOCS / "recipes" / f"{task}.md"
        results = load_results(task)
        if page.exists():
            replace_between_markers(page, task_table(task, results), START, END)
            if THREADS_START in page.read_text():
                replace_between_markers(page, thread_table(task, load_thread_runs(task)), THREADS_START, THREADS_END)
        write_curves(task, results)
    replace_between_markers(DOCS / "recipes.md", summary_table(), START, END)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--task", choices=sorted(TASKS), help="run this recipe's variants, then render")
    parser.add_argument("--variants", nargs="+", choices=ALL_VARIANTS, default=list(VARIANTS), help="untuned: HF only")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0], help="run every variant with each seed")
    parser.add_argument("--threads", type=int, help="run with OMP_NUM_THREADS=N, kept apart for the thread-count table")
    parser.add_argument("--render", action="store_true", help="only render the docs from the recorded JSON files")
    opts = parser.parse_args()
    if opts.task and not opts.render:
        run_task(opts.task, opts.variants, opts.seeds, opts.threads)
    render([opts.task] if opts.task else list(TASKS))


if __name__ == "__main__":
    main()
