"""The recipes need nothing beside the repository: the recipe tests run every recipe's script on one process from
``ROOT``, a copy of the repository's files (git's list) in a fresh folder, with no data folder beside it and no
``LIGHTNING_DP_DATA`` (``recipe_helpers``), on the committed test subsets. This checks that copy and the environment
its scripts run in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from recipe_helpers import CHECKOUT, ROOT, TEST_DATA, script_env


def test_the_recipe_tests_run_a_copy_of_the_repository_alone_in_its_folder(tmp_path: Path) -> None:
    assert ROOT != CHECKOUT and [p.name for p in ROOT.parent.iterdir()] == [ROOT.name]
    assert TEST_DATA.is_relative_to(ROOT) and (TEST_DATA / "README.md").is_file()
    assert (ROOT / "recipes" / "glue.py").is_file() and (ROOT / "configs" / "glue_offline.yaml").is_file()
    assert not (ROOT / ".git").exists()
    env = script_env()
    assert "LIGHTNING_DP_DATA" not in env and env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    found = subprocess.run(
        [sys.executable, "-c", "import lightning_dp; print(lightning_dp.__file__)"],
        cwd=tmp_path,  # not the copy: the import must come through PYTHONPATH, as for a script in recipes/
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(found.stdout.strip()).is_relative_to(ROOT)  # the copy's code, not the checkout's
