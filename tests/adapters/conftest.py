"""The tests in this folder import the shared helpers of ``tests/`` (``helpers``, ``hf_helpers``, ...) as the tests
there do: pytest puts a test file's own folder on ``sys.path``, which here is ``tests/adapters``, so ``tests/`` is added
too."""

import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parents[1])
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
