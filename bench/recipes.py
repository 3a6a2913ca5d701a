"""Run the recipes' documented variants and render their result tables into the docs.

    nice -n 15 python bench/recipes.py --task glue          # the five variants of one recipe, then render
    python bench/recipes.py --render                        # only re-render the docs from docs/recipes/*/*.json

Each variant runs the recipe's docs configuration unchanged plus the variant's flags, through the same script users
run (``python recipes/<task>.py --config configs/<name>_offline.yaml ...``), one process after another (each in its
own process, so no state is shared), and keeps the run's ``results.json`` as ``docs/recipes/<task>/<variant>.json``.
The offline configurations read the full local copies of the data from the data root ``LIGHTNING_DP_DATA`` (set it
first; docs/recipes.md, "Local data").
Rendering puts one table per task between the ``<!-- results -->`` markers of ``docs/recipes/<task>.md`` and the
summary table between those of ``docs/recipes.md``; the tables hold only what the JSON files say.
"""

from __future__ import annotations

import argparse
import importlib
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from records import replace_between_markers

from lightning_dp.help_format import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
START, END = "<!-- results:start -->", "<!-- results:end -->"

#: task -> (script users run, docs configuration, metric of the summary table).
TASKS = {
    "glue": ("recipes/glue.py", "configs/glue_offline.yaml", "accuracy"),
    "e2e_dart": ("recipes/e2e_dart.py", "configs/e2e_dart_offline.yaml", "bleu"),
    "billsum": ("recipes/billsum.py", "configs/billsum_offline.yaml", "rougeL"),
    "hotpotqa": ("recipes/hotpotqa.py", "configs/hotpotqa_offline.yaml", "f1"),
    "cifar": ("recipes/cifar.py", "configs/cifar10_offline.yaml", "accuracy"),
}
NOISE_PARAMETERS = ("noise_multiplier", "noise_scale", "gamma_shape", "gamma_scale")
VARIANTS = ("non-private", "gaussian-eps3", "gaussian-eps8", "lap2-eps3", "lap2-eps8")


def hf_variant_flags(variant: str, results_file: str) -> list[str]:
    """The flags of ``variant`` for an HF recipe (``RecipeArguments`` / ``PrivacyArguments`` fields)."""
    flags = ["--results_file", results_file]
    if variant == "non-private":
        return [*flags, "--dp", "false"]
    noise, epsilon = variant.split("-eps")
    return [*flags, "--dp", "true", "--noise", noise, "--target_epsilon", epsilon]


def variant_command(task: str, variant: str, results_file: str, output_dir: str) -> list[str]:
    """The command line that runs ``variant`` of ``task``'s docs configuration."""
    script, config, _ = TASKS[task]
    command = [sys.executable, script, "--config", config]
    if task == "cifar":
        cifar = importlib.import_module("lightning_dp.recipes.cifar")
        return [*command, *cifar.variant_flags(variant, results_file)]
    return [*command, *hf_variant_flags(variant, results_file), "--output_dir", output_dir]


def run_task(task: str, variants: list[str]) -> None:
    folder = DOCS / "recipes" / task
    folder.mkdir(parents=True, exist_ok=True)
    for variant in variants:
        results = folder / f"{variant}.json"
        with tempfile.TemporaryDirectory() as output_dir:
            command = variant_command(task, variant, str(results.relative_to(ROOT)), output_dir)
            print("$", shlex.join(command), flush=True)
            subprocess.run(command, cwd=ROOT, check=True)


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _noise_text(privacy: dict | None) -> str:
    if privacy is None:
        return "none"
    inner = ", ".join(f"{k}={privacy[k]:.4g}" for k in NOISE_PARAMETERS if k in privacy)
    return f"{privacy['noise']} ({inner})"


def load_results(task: str) -> dict[str, dict]:
    """``variant -> results.json`` of ``task`` for the variants that have run."""
    folder = DOCS / "recipes" / task
    return {v: json.loads((folder / f"{v}.json").read_text()) for v in VARIANTS if (folder / f"{v}.json").exists()}


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


def task_table(task: str, results: dict[str, dict]) -> str:
    """The Markdown table (and commands) of one task's variants."""
    if not results:
        return "(no runs recorded yet)"
    keys = list(next(iter(results.values()))["metrics"])
    head = ["variant", *keys, "epsilon spent", "delta", "noise", "clip C", "steps", "batch", "train s", "eval s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for variant, result in results.items():
        privacy = result.get("privacy")
        row = [
            variant,
            *(_fmt(result["metrics"].get(k)) for k in keys),
            _fmt(privacy and privacy["epsilon"], 3),
            "-" if privacy is None else f"{privacy['delta']:.3g}",
            _noise_text(privacy),
            "-" if privacy is None else f"{privacy['max_grad_norm']:g}",
            str(result["steps"]),
            str(result["expected_batch"]),
            _fmt(result["train_seconds"], 0),
            _fmt(result["eval_seconds"], 0),
        ]
        lines.append("| " + " | ".join(row) + " |")
    sizes = next(iter(results.values()))
    lines += [
        "",
        f"Training examples: {sizes['train_size']}; evaluation examples: {sizes['eval_size']}; trainable parameters: "
        f"{sizes['trainable_params']:,}; processes: {sizes['world_size']}. Scores in percent. Commands (from the "
        "repository root):",
        "",
        "```bash",
        *(display_command(task, result["command"]) for result in results.values()),
        "```",
    ]
    return "\n".join(lines)


def summary_table() -> str:
    """One row per task: its headline metric in every variant."""
    head = ["recipe", "metric", *VARIANTS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for task in TASKS:
        results = load_results(task)
        if not results:
            lines.append(f"| [{task}](recipes/{task}.md) | (not run) |" + " - |" * len(VARIANTS))
            continue
        metric = TASKS[task][2]
        cells = []
        for variant in VARIANTS:
            result = results.get(variant)
            if result is None:
                cells.append("-")
                continue
            score = _fmt(result["metrics"][metric])
            privacy = result.get("privacy")
            cells.append(score if privacy is None else f"{score} (eps {privacy['epsilon']:.2f})")
        lines.append(f"| [{task}](recipes/{task}.md) | {metric} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render(tasks: list[str]) -> None:
    """Re-render the tables of ``tasks``' pages and the summary table of docs/recipes.md."""
    for task in tasks:
        page = DOCS / "recipes" / f"{task}.md"
        if page.exists():
            replace_between_markers(page, task_table(task, load_results(task)), START, END)
    replace_between_markers(DOCS / "recipes.md", summary_table(), START, END)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--task", choices=sorted(TASKS), help="run this recipe's variants, then render")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--render", action="store_true", help="only render the docs from the recorded JSON files")
    opts = parser.parse_args()
    if opts.task and not opts.render:
        run_task(opts.task, opts.variants)
    render([opts.task] if opts.task else list(TASKS))


if __name__ == "__main__":
    main()
