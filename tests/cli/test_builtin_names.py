"""The names ``lightning-dp demo`` offers without importing the registries are the registries' own, in their order."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from lightning_dp.cli import builtin_names

ROOT = Path(__file__).resolve().parents[2]


def test_builtin_names_are_the_registries_names() -> None:
    # A fresh interpreter: this process's registries may hold names a test registered.
    code = (
        "import json\n"
        "from lightning_dp.accounting import ACCOUNTANTS\n"
        "from lightning_dp.clipping import AUTO, clipping_choices\n"
        "from lightning_dp.mechanisms import MECHANISMS\n"
        "print(json.dumps([AUTO, clipping_choices(), list(MECHANISMS), list(ACCOUNTANTS)]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    auto, clipping, noises, accountants = json.loads(done.stdout.splitlines()[-1])
    assert builtin_names.AUTO == auto
    assert list(builtin_names.CLIPPING) == clipping
    assert list(builtin_names.NOISES) == noises
    assert list(builtin_names.ACCOUNTANTS) == accountants
