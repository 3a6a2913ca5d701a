"""Summaries of ``bench/recipes.py``'s recorded runs (``docs/recipes/<task>/<variant>[.seed<S>].json``) for the pages
that compare some of its variants (docs/adaptive_clipping.md, docs/correlated_noise.md)."""

from __future__ import annotations

from typing import Any

from records import mean_std, value_range

from recipes import TASKS, display_command


def compared(results: dict[str, list[dict[str, Any]]], variants: list[str]) -> dict[str, list[dict[str, Any]]]:
    """The runs of ``variants`` recorded in ``results`` (``recipes.load_results``), in the order of ``variants``."""
    return {variant: results[variant] for variant in variants if variant in results}


def summary(task: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One variant's runs: the task's metric (``mean``, sample ``std``, ``seeds``, and as ``metric`` the mean +- std, or
    the one value of a single seed), the ``epsilon`` and
    ``noise_multiplier`` they report (one value or their range), the ``accountant`` and the ``machines`` (CPU and
    thread count of each run, deduplicated)."""
    mean, std = mean_std([run["metrics"][TASKS[task][2]] for run in runs])
    privacy = [run["privacy"] for run in runs]
    machines = sorted(
        {f"{run['environment'].get('device_name', 'CPU')} ({run['environment']['threads']})" for run in runs}
    )
    return {
        "mean": mean,
        "std": std,
        "seeds": len(runs),
        "metric": f"{mean:.2f} +- {std:.2f}" if len(runs) > 1 else f"{mean:.2f}",
        "epsilon": value_range(privacy, "epsilon", ".3f"),
        "noise_multiplier": value_range(privacy, "noise_multiplier", ".4g"),
        "accountant": privacy[0]["accountant"],
        "machines": ", ".join(machines),
    }


def commands(task: str, shown: dict[str, list[dict[str, Any]]]) -> list[str]:
    """A fenced block of the command of every run in ``shown``, as a user types it."""
    lines = [display_command(task, run["command"]) for runs in shown.values() for run in runs]
    return ["```bash", *lines, "```"]
