"""References in the repository point inside it: the design document is ``docs/design.md``, nothing cites the notes,
papers or data kept beside the repository (local data is wherever ``--data_dir`` / ``LIGHTNING_DP_DATA`` say), and
nothing cites issue numbers.

Scans every ``.py``, ``.md``, ``.yaml`` and ``.toml`` file of the repository (tracked or untracked but not ignored,
when git is available) except this one.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from process_helpers import repository_files

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = {".py", ".md", ".yaml", ".toml"}
#: folders never scanned when git cannot list the files (build outputs, environments, logs).
SKIPPED_DIRS = {"__pycache__", "build", "dist", "lightning_logs", "runs", "node_modules", "venv"}

#: any spelling of the design document's file name; only ``docs/design.md`` (or a relative link inside docs/) is valid.
DESIGN_NAME = re.compile(r"design\.md", re.IGNORECASE)
#: a path into the folder beside the repository: outside the project, whatever it holds.
SHARED = re.compile(r"\.\./shared\b")
#: "issue 10", "Issue #3", "issues 7", "issue-12".
ISSUE_NUMBER = re.compile(r"\b[Ii]ssues?[ _-]?#?\d+")


def _files() -> list[Path]:
    paths = [ROOT / name for name in repository_files()]
    if not paths:  # no git: walk the tree
        for folder, dirs, names in os.walk(ROOT):
            dirs[:] = [d for d in dirs if not (d.startswith(".") or d in SKIPPED_DIRS or d.endswith(".egg-info"))]
            paths += [Path(folder) / name for name in names]
    this = Path(__file__).resolve()
    return sorted(p for p in paths if p.suffix in SUFFIXES and p.is_file() and p.resolve() != this)


def _valid_design_reference(text: str, match: re.Match[str], path: Path) -> bool:
    if match.group() != "design.md":
        return False  # upper-case or mixed-case spellings: the external notes, or a misspelt reference
    before = text[: match.start()]
    if before.endswith("docs/"):
        return True
    return before.endswith("](") and path.parent == ROOT / "docs"  # a relative link from another page of docs/


def _problems(text: str, path: Path) -> list[str]:
    """``"path:line: what"`` for every invalid reference in ``text``, read from (or standing for) the file ``path``."""
    found = []
    for match in DESIGN_NAME.finditer(text):
        if not _valid_design_reference(text, match, path):
            found.append((match.start(), f"cites {match.group()!r}; cite docs/design.md and a section"))
    for match in SHARED.finditer(text):
        found.append((match.start(), f"points outside the repository ({match.group()!r})"))
    for match in ISSUE_NUMBER.finditer(text):
        found.append((match.start(), f"cites an issue number ({match.group()!r}); say what is meant instead"))
    rel = path.relative_to(ROOT)
    return [f"{rel}:{text.count(chr(10), 0, offset) + 1}: {message}" for offset, message in sorted(found)]


def test_references_stay_inside_the_repository() -> None:
    files = _files()
    assert ROOT / "docs" / "design.md" in files, "docs/design.md is missing"
    problems = [
        problem for path in files for problem in _problems(path.read_text(encoding="utf-8", errors="replace"), path)
    ]
    assert not problems, "\n".join(problems)


def test_the_rules_catch_what_they_should() -> None:
    bad = (
        f"See {'DESIGN'}.md section 4 and ../shared/seeds/x.md (issue 10, item 2); Issue #3; issues 7.\n"
        "[x](design.md) outside docs/; Design.md; design.md alone; data in ../shared/data/e2e.\n"
    )
    assert len(_problems(bad, ROOT / "lightning_dp" / "x.py")) == 9
    good = "docs/design.md section 4; [docs/design.md section 3.1](design.md#31-the-guarantee); ROOT/e2e\n"
    assert _problems(good, ROOT / "docs" / "page.md") == []
    assert len(_problems("[x](design.md)", ROOT / "docs" / "recipes" / "page.md")) == 1
