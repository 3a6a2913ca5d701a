"""The recipes need nothing beside the repository: in a copy of its files in a fresh folder (no data folder beside it,
no ``LIGHTNING_DP_DATA``), every recipe's script runs end to end on the committed test subsets (each recipe's smoke
test of the default suite, on a tiny model), and a few data tests of the default suite pass, with no failure and no
skip."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from process_helpers import repository_files
from recipe_helpers import ROOT

#: Recipe tests of the default suite that read the committed subsets: each recipe's script run end to end on a tiny
#: model (the fastest such test of each script, and of configs/e2e_full_offline.yaml: 10 to 25 s each on one thread),
#: then cheap data tests.
SELECTED = [
    "tests/recipes/test_recipe_glue.py::test_smoke_docs_config_on_a_tiny_model",
    "tests/recipes/test_recipe_e2e_dart.py::test_smoke_docs_config_on_a_tiny_model[e2e]",
    # configs/e2e_full_offline.yaml:
    "tests/recipes/test_recipe_e2e_dart.py::test_full_config_records_the_evaluation_loss_curve_on_a_tiny_model",
    "tests/recipes/test_recipe_billsum.py::test_smoke_users_script_tiny_model",
    "tests/recipes/test_recipe_hotpotqa.py::test_smoke_users_script_tiny_model",
    "tests/recipes/test_recipe_cifar.py::test_script_smoke",
    "tests/recipes/test_recipe_glue.py::test_local_qnli_split_is_deterministic_and_disjoint",
    "tests/recipes/test_recipe_e2e_dart.py::test_local_copies_are_read_in_place_with_every_reference",
    "tests/recipes/test_recipe_billsum.py::test_prompt_and_deterministic_local_split",
    "tests/recipes/test_recipe_hotpotqa.py::test_deterministic_local_split",
    "tests/recipes/test_recipe_cifar.py::test_more_examples_than_the_data_has",
]
#: Never copied when git cannot list the files.
IGNORED = shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", ".ruff_cache", "*.egg-info", "runs", "build")


def copy_repository(target: Path) -> None:
    """Copy the repository's files to ``target`` (git's list, else the whole tree without caches and outputs)."""
    files = repository_files()
    if not files:
        shutil.copytree(ROOT, target, ignore=IGNORED)
        return
    for name in files:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target / name)


def test_recipe_tests_pass_in_a_copy_of_the_repository(tmp_path: Path) -> None:
    copy = tmp_path / "repository"
    copy_repository(copy)
    assert not (tmp_path / "shared").exists()
    env = {k: v for k, v in os.environ.items() if k not in ("LIGHTNING_DP_DATA", "PYTHONPATH")}
    env["PYTHONPATH"] = str(copy)
    found = subprocess.run(
        [sys.executable, "-c", "import lightning_dp; print(lightning_dp.__file__)"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(found.stdout.strip()).is_relative_to(copy)  # the copy's code, not this checkout's
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *SELECTED],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(rf"\b{len(SELECTED)} passed\b", summary) and "skipped" not in summary, summary
