"""Helpers of the recipe tests: where their data is, and running a recipe through the script users run, in its own
process.

The default suite reads the small real subsets committed in ``tests/data`` (:data:`TEST_DATA`; see its README.md),
passed as ``--data_dir``, so it needs nothing beside the repository. The full local copies serve only the slow tests
(:func:`needs_full_data`), found through ``LIGHTNING_DP_DATA`` as the recipes find them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The data root of the default suite: small real subsets in the layout the recipes read.
TEST_DATA = ROOT / "tests" / "data"
#: The data root of the full local copies (``LIGHTNING_DP_DATA``), for the slow tests; ``None`` when unset.
FULL_DATA = Path(os.environ["LIGHTNING_DP_DATA"]) if os.environ.get("LIGHTNING_DP_DATA") else None


def needs_full_data(*files: str) -> pytest.MarkDecorator:
    """Skip unless ``LIGHTNING_DP_DATA`` names a data root holding ``files`` (paths relative to it)."""
    missing = FULL_DATA is None or not all((FULL_DATA / name).is_file() for name in files)
    return pytest.mark.skipif(
        missing,
        reason=f"needs the full local copies: set LIGHTNING_DP_DATA to their data root (with {', '.join(files)})",
    )


def script_env() -> dict[str, str]:
    """The environment of a recipe run in a subprocess: this checkout first on ``PYTHONPATH``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def run_recipe_script(
    script: str, config: str, output_dir: Path, *flags: str, data_dir: Path | None = TEST_DATA, timeout: float = 1200
) -> dict:
    """Run ``python recipes/SCRIPT --config configs/CONFIG --data_dir DATA_DIR FLAGS`` from the repository root (this
    checkout first on ``PYTHONPATH``) and return its ``results.json``; a failing run fails the test with the run's
    stderr. ``data_dir`` defaults to the test subsets; ``FULL_DATA`` for the slow tests."""
    results = output_dir / "results.json"
    command = [sys.executable, f"recipes/{script}", "--config", f"configs/{config}", "--output_dir", str(output_dir)]
    if data_dir is not None:
        command += ["--data_dir", str(data_dir)]
    done = subprocess.run(
        [*command, *flags], cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(results.read_text(encoding="utf-8"))


def assert_dp_result(result: dict, metric_keys: set[str], target_epsilon: float) -> None:
    """The run reports every metric key as a finite number, and a finite epsilon spent within the target."""
    assert set(result["metrics"]) == metric_keys
    assert all(math.isfinite(v) for v in result["metrics"].values())
    epsilon = result["privacy"]["epsilon"]
    assert math.isfinite(epsilon) and 0 < epsilon <= target_epsilon * (1 + 1e-6)


# ------------------------------------------------------------------- the CIFAR-10 recipe's tiny runs (Lightning CLI)
#: the CIFAR-10 recipe's offline configuration (the one its tests run, on the test subset).
CIFAR_CONFIG = ROOT / "configs" / "cifar10_offline.yaml"
#: the keys of the CIFAR-10 recipe's ``results.json``.
CIFAR_RESULT_KEYS = {
    "task",
    "dp",
    "metrics",
    "privacy",
    "train_size",
    "eval_size",
    "steps",
    "expected_batch",
    "trainable_params",
    "train_seconds",
    "eval_seconds",
    "world_size",
    "environment",
    "arguments",
    "command",
}


def cifar_tiny_flags(tmp_path: Path, data_flag: str = "--data.init_args.data_dir") -> list[str]:
    """A few steps on a few images of the test subset (given by ``data_flag``): the docs config's model family at
    its smallest."""
    return [
        f"{data_flag}={TEST_DATA}",
        "--data.init_args.train_size=64",
        "--data.init_args.eval_size=40",
        "--data.init_args.batch_size=16",
        "--trainer.max_steps=2",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.callbacks.init_args.path={tmp_path / 'results.json'}",
    ]


def read_cifar_results(tmp_path: Path) -> dict:
    """``results.json`` of a :func:`cifar_tiny_flags` run, checked for its keys, accuracy range and sizes."""
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result) == CIFAR_RESULT_KEYS
    assert 0.0 <= result["metrics"]["accuracy"] <= 100.0
    assert result["train_size"] == 64 and result["eval_size"] == 40 and result["steps"] == 2
    return result
