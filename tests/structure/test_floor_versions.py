"""scripts/floor_versions.py reads the lower bounds it installs from pyproject.toml."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("floor_versions", ROOT / "scripts" / "floor_versions.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_floored_library_is_pinned_at_its_lower_bound() -> None:
    script = _script()
    pinned = script.floors()
    assert sorted(pinned) == sorted(script.FLOORED)
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    for requirement in pinned.values():
        base, version = requirement.split("==")
        assert f'"{base}>={version}' in text, requirement
    assert pinned["jsonargparse"].startswith("jsonargparse[signatures]==")  # the extra the package needs


def test_a_missing_or_conflicting_bound_is_refused(tmp_path) -> None:
    script = _script()
    lines = [f'"{name}>=1.0"' for name in script.FLOORED]
    (tmp_path / "missing.toml").write_text("\n".join(lines[1:]), encoding="utf-8")
    with pytest.raises(ValueError, match=f"no '>=' bound in missing.toml for {script.FLOORED[0]}"):
        script.floors(tmp_path / "missing.toml")
    (tmp_path / "two.toml").write_text("\n".join([*lines, f'"{script.FLOORED[0]}>=2.0"']), encoding="utf-8")
    with pytest.raises(ValueError, match="two lower bounds"):
        script.floors(tmp_path / "two.toml")


def test_the_private_trainer_overrides_are_tested_from_the_transformers_floor() -> None:
    from lightning_dp.hf.sharded_checkpoints import TRANSFORMERS_TESTED

    floor = _script().floors()["transformers"].split("==")[1]
    assert TRANSFORMERS_TESTED[0].split(".")[:2] == floor.split(".")[:2]
