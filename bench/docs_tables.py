"""Writing rendered result tables into the docs between marker lines (shared by the bench scripts)."""

from __future__ import annotations

from pathlib import Path


def replace_between_markers(path: Path, text: str, start: str, end: str) -> None:
    """Put ``text`` between the marker lines ``start`` and ``end`` of ``path``, keeping the rest of the file.

    Raises:
        ValueError: the file lacks one of the markers.
    """
    content = path.read_text(encoding="utf-8")
    if start not in content or end not in content:
        raise ValueError(f"{path} lacks the lines {start} and {end}")
    before, rest = content.split(start, 1)
    _, after = rest.split(end, 1)
    path.write_text(f"{before}{start}\n{text}\n{end}{after}", encoding="utf-8")
