"""Helpers of the recipe tests: run a recipe through the script users run, in its own process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_recipe_script(script: str, config: str, output_dir: Path, *flags: str, timeout: float = 1200) -> dict:
    """Run ``python recipes/SCRIPT --config configs/CONFIG FLAGS`` from the repository root (this checkout first on
    ``PYTHONPATH``) and return its ``results.json``; a failing run fails the test with the run's stderr."""
    results = output_dir / "results.json"
    command = [sys.executable, f"recipes/{script}", "--config", f"configs/{config}", "--output_dir", str(output_dir)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [*command, *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(results.read_text(encoding="utf-8"))


def assert_dp_result(result: dict, metric_keys: set[str], target_epsilon: float) -> None:
    """The run reports every metric key as a finite number, and a finite epsilon spent within the target."""
    assert set(result["metrics"]) == metric_keys
    assert all(math.isfinite(v) for v in result["metrics"].values())
    epsilon = result["privacy"]["epsilon"]
    assert math.isfinite(epsilon) and 0 < epsilon <= target_epsilon * (1 + 1e-6)
