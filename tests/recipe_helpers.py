"""Helpers of the recipe tests: where their data is, and running a recipe through the script users run, in its own
process.

The recipe tests run the recipes' scripts on one process from :data:`ROOT`, a copy of the repository's files (git's
list) in a fresh temporary folder with no data folder beside it, made once per test process, and without
``LIGHTNING_DP_DATA`` (:func:`script_env`): each such run shows that the recipe needs nothing but the repository.
:data:`ROOT` is a different folder in each test process: parametrize over paths as ``Path`` objects (pytest numbers
them), never as strings, or pytest-xdist's workers collect different tests. The default suite reads
the small real subsets committed in ``tests/data`` (:data:`TEST_DATA`; see its README.md), passed as ``--data_dir``.
The full local copies serve only the slow tests (:func:`needs_full_data`), passed as ``--data_dir`` too.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from process_helpers import ROOT as CHECKOUT
from process_helpers import repository_files

#: Never copied when git cannot list the files: git's own folder and what .gitignore lists.
IGNORED = shutil.ignore_patterns(
    ".git", "__pycache__", "*.egg-info", ".venv", "lightning_logs", "runs", ".pytest_cache", ".ruff_cache",
    ".mypy_cache", "build", "dist", "*.ckpt", "wandb", "mlruns", "sst2_hf_out", "site",
)  # fmt: skip


def copy_repository(target: Path) -> None:
    """Copy the checkout's files to ``target`` (git's list, else the whole tree without caches and outputs)."""
    files = repository_files()
    if not files:
        shutil.copytree(CHECKOUT, target, ignore=IGNORED)
        return
    for name in files:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(CHECKOUT / name, target / name)


def _standalone_copy() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="lightning_dp_standalone_"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    copy_repository(folder / "repository")
    return folder / "repository"


#: The repository the recipe tests run: a copy of the checkout's files, alone in its temporary folder.
ROOT = _standalone_copy()
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
    """The environment of a recipe run in a subprocess: :data:`ROOT` first on ``PYTHONPATH`` and the checkout off it
    (the copy's ``lightning_dp``, not the checkout's), no ``LIGHTNING_DP_DATA``."""
    env = {name: value for name, value in os.environ.items() if name != "LIGHTNING_DP_DATA"}
    entries = env.get("PYTHONPATH", "").split(os.pathsep)
    kept = [entry for entry in entries if entry and Path(entry).resolve() != CHECKOUT]
    return {**env, "PYTHONPATH": os.pathsep.join([str(ROOT), *kept])}


def run_recipe_script(
    script: str, config: str, output_dir: Path, *flags: str, data_dir: Path | None = TEST_DATA, timeout: float = 1200
) -> dict:
    """Run ``python recipes/SCRIPT --config configs/CONFIG --data_dir DATA_DIR FLAGS`` from :data:`ROOT` (in
    :func:`script_env`) and return its ``results.json``; a failing run fails the test with the run's
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
