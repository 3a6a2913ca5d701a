"""Loading a bench script as a module, rendering a record into a scratch docs page, and reading a docs page against
the rendering of its committed records (for the rendering tests)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

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
    monkeypatch.setattr(bench, "PAGE", page)
    monkeypatch.setattr(bench, "RECORDS", records)
    bench.render()
    return page.read_text()


def render_page_and_figure(bench: ModuleType, monkeypatch, tmp_path: Path, name: str, record: dict) -> str:
    """Render ``record`` (kept as ``NAME.json``) with the script's ``render()`` into a scratch page holding "(no run
    recorded yet)" between its markers and a scratch ``figure.png`` (the script's ``RECORDS``, ``PAGE`` and
    ``FIGURE`` patched); the page."""
    records = tmp_path / "records"
    records.mkdir()
    (records / f"{name}.json").write_text(json.dumps(record))
    page = tmp_path / "page.md"
    page.write_text(f"intro\n{bench.START}\n(no run recorded yet)\n{bench.END}\nend\n")
    for attribute, value in (("RECORDS", records), ("PAGE", page), ("FIGURE", tmp_path / "figure.png")):
        monkeypatch.setattr(bench, attribute, value)
    bench.render()
    return page.read_text()


def page_and_rendering(bench: ModuleType, command: str) -> tuple[str, str]:
    """The section of ``bench.PAGE`` between the script's markers, and ``bench.markdown`` of every committed record in
    ``bench.RECORDS`` joined as ``records.render_records`` joins them: equal when the page is the rendering of the
    records. Fails the test, naming ``command`` (the one that records a run), when ``bench.RECORDS`` holds none."""
    records = committed_records(bench, command)
    rendered = "\n\n".join(bench.markdown(json.loads(path.read_text(encoding="utf-8"))) for path in records)
    return page_section(bench), rendered


def committed_records(bench: ModuleType, command: str) -> list[Path]:
    """The JSON records in ``bench.RECORDS``, in file-name order. Fails the test, naming ``command`` (the one that
    records a run), when there is none."""
    records = sorted(bench.RECORDS.glob("*.json"))
    if not records:
        pytest.fail(f"{bench.RECORDS.relative_to(ROOT)}/ holds no record: run {command}")
    return records


def page_section(bench: ModuleType) -> str:
    """The text of ``bench.PAGE`` between the script's markers ``bench.START`` and ``bench.END``."""
    return bench.PAGE.read_text(encoding="utf-8").split(bench.START, 1)[1].split(bench.END, 1)[0].strip("\n")
