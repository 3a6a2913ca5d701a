"""Loading a bench script as a module and rendering a record into a scratch docs page (for the rendering tests)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_bench(monkeypatch, script: str) -> ModuleType:
    """``bench/<script>.py`` as a module, with ``bench/`` on the path as when run as ``python bench/<script>.py``."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(f"bench_{script}", ROOT / "bench" / f"{script}.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def render_into_scratch_page(bench: ModuleType, monkeypatch, tmp_path: Path, record: dict) -> str:
    """Render ``record`` with the script's ``render()`` into a page holding ``old`` between its markers; the page."""
    records = tmp_path / "docs" / "bench" / bench.RECORDS.name
    records.mkdir(parents=True)
    (records / "a.json").write_text(json.dumps(record))
    page = tmp_path / "docs" / "performance.md"
    page.write_text(f"intro\n{bench.START}\nold\n{bench.END}\nend\n")
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    monkeypatch.setattr(bench, "RECORDS", records)
    bench.render()
    return page.read_text()
