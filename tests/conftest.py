"""The test tree mirrors the package (``tests/clipping/`` for ``lightning_dp/clipping``, ...); the shared helpers stay
in this folder (``helpers``, ``clipping_helpers``, ``hf_helpers``, ``process_helpers``, ...) and the scripts the tests
launch in subprocesses are in ``scripts/``. Every test imports the helpers by their plain names (``from helpers import
TinyRegressor``), so this folder is put on ``sys.path`` here, whichever subfolder the test is in; a test file is never
imported from another one."""

import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
