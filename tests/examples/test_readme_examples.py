"""The Python examples of README.md run as printed: each ```python block is executed on its own, in a temporary
folder (the Lightning one trains on scikit-learn's digits, the HF one a tiny BERT built from a config; no download),
and each ends at the epsilon it was calibrated for."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"^```python\n(.*?)^```$", README, flags=re.MULTILINE | re.DOTALL)


def run_block(code: str, index: int) -> dict:
    """Execute one README block as a script; its global names."""
    namespace = {"__name__": "__main__"}
    exec(compile(code, f"README.md python block {index}", "exec"), namespace)
    return namespace


def test_the_readme_has_the_two_examples() -> None:
    assert len(BLOCKS) == 2 and "DPStrategy(" in BLOCKS[0] and "DPTrainer(" in BLOCKS[1]


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs_to_its_epsilon(index: int, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the examples write their logs and checkpoints to the working folder
    names = run_block(BLOCKS[index], index)
    queries = names["strategy"] if "strategy" in names else names["trainer"]
    assert 2.9 < queries.get_epsilon() <= 3.0
