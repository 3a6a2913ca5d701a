"""What the bench scripts share: recording a run as JSON and rendering the records into the docs between marker
lines (``--record NAME`` / ``--render``), and the environment a record states."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning_dp
from lightning_dp.runtime.environment import run_environment


def plural(count: Any, noun: str) -> str:
    """``count`` and ``noun``, the noun with an ``s`` unless the count is 1: ``"1 thread"``, ``"2 threads"``,
    ``"? threads"`` (for a count a record lacks)."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def mean_std(values: list[float]) -> tuple[float, float]:
    """The mean and the sample standard deviation (n - 1; 0 for one value)."""
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def value_range(runs: list[dict[str, Any]], key: str, spec: str = "g") -> str:
    """``runs``' values of ``key``, one per run: the one value (``format(value, spec)``) when every run shows the
    same, else ``smallest to largest``."""
    values = [run[key] for run in runs]
    low, high = format(min(values), spec), format(max(values), spec)
    return low if low == high else f"{low} to {high}"


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


def render_records(
    records: Path,
    markdown: Callable[[dict[str, Any]], str],
    page: Path,
    start: str,
    end: str,
    empty: str = "(no run recorded yet)",
) -> None:
    """Render every JSON record in ``records`` (in file-name order) with ``markdown`` between the markers of
    ``page``; ``empty`` there when it holds none."""
    rendered = [markdown(json.loads(path.read_text(encoding="utf-8"))) for path in sorted(records.glob("*.json"))]
    replace_between_markers(page, "\n\n".join(rendered) or empty, start, end)


def render_records_and_figure(
    records: Path,
    markdown: Callable[[dict[str, Any]], str],
    page: Path,
    start: str,
    end: str,
    figure: Callable[[dict[str, Any], Path], None],
    figure_path: Path,
) -> None:
    """:func:`render_records`, then draw ``figure`` of the last record (in file-name order) into ``figure_path``."""
    render_records(records, markdown, page, start, end)
    latest = sorted(records.glob("*.json"))
    if latest:
        figure(json.loads(latest[-1].read_text(encoding="utf-8")), figure_path)


def run_or_render(
    args: argparse.Namespace,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    render: Callable[[], None],
    *,
    script: str,
    records: Path,
    report_lines: Callable[[dict[str, Any]], list[str]],
) -> None:
    """A bench's command line after parsing: ``--render`` only re-renders; otherwise run, then :func:`finish` (with
    the CPU environment read after the run, which may set the thread count, and the load average from before it)."""
    if args.render:
        render()
        return
    load_before = os.getloadavg()[0]
    out = run(args)
    env = {**environment("cpu"), "load_before": load_before}
    finish(args, out, env, script=script, records=records, render=render, report_lines=report_lines)


def add_record_options(parser: argparse.ArgumentParser, records: Path) -> None:
    """``--json``, ``--record NAME`` (write ``records/NAME.json`` and re-render the docs) and ``--render``."""
    parser.add_argument("--json", action="store_true", help="print the record as JSON instead of the report")
    parser.add_argument("--record", metavar="NAME", help=f"also write the record to {records}/NAME.json and "
                        "re-render the docs from all records")  # fmt: skip
    parser.add_argument("--render", action="store_true", help="only re-render the docs from the records")


def _git(tree: Path, *command: str) -> str | None:
    """What ``git -C tree COMMAND`` prints, or None where it fails (no git, not a checkout)."""
    try:
        done = subprocess.run(["git", "-C", str(tree), *command], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def short_head(tree: Path) -> str | None:
    """The short hash of the commit checked out in ``tree``; None outside a git checkout."""
    return _git(tree, "rev-parse", "--short", "HEAD")


def library_commit() -> str | None:
    """The commit of the library that a run measures: :func:`short_head` of the checkout that ``lightning_dp`` is
    imported from, with ``+`` where its ``lightning_dp/`` has changes not committed; None outside a git checkout."""
    root = Path(lightning_dp.__file__).resolve().parent.parent
    head, changes = short_head(root), _git(root, "status", "--porcelain", "--", "lightning_dp")
    return None if head is None else head + ("+" if changes else "")


def environment(device: str) -> dict[str, Any]:
    """What the numbers depend on (:func:`lightning_dp.runtime.environment.run_environment`: versions, threads, CPU
    kernels, the device's name; the library's commit, :func:`library_commit`) and the load average before the run
    (the caller adds ``load_after``)."""
    return {**run_environment(device), "commit": library_commit(), "load_before": os.getloadavg()[0]}


def reproducing_argv(argv: list[str], drop: tuple[str, ...] = ()) -> list[str]:
    """``argv`` without ``--json``, ``--record NAME`` (or ``--record=NAME``) and the flags in ``drop``: the arguments
    of the command a record states, the one that reproduces its runs."""
    kept: list[str] = []
    for arg in argv:
        if kept[-1:] == ["--record"]:  # arg is NAME: drop both
            kept.pop()
        elif arg not in ("--json", *drop) and not arg.startswith("--record="):
            kept.append(arg)
    return kept


def finish(
    args: argparse.Namespace,
    out: dict[str, Any],
    env: dict[str, Any],
    *,
    script: str,
    records: Path,
    render: Callable[[], None],
    report_lines: Callable[[dict[str, Any]], list[str]],
) -> None:
    """Complete the record of a run (the command that reproduces it, :func:`reproducing_argv`; the arguments; the
    environment, with ``load_after``), write it with ``--record`` and re-render, then print it."""
    env["load_after"] = os.getloadavg()[0]
    record = {
        "command": shlex.join(["python", script, *reproducing_argv(sys.argv[1:])]),
        "args": vars(args),
        "environment": env,
        **out,
    }
    if args.record:
        records.mkdir(parents=True, exist_ok=True)
        (records / f"{args.record}.json").write_text(json.dumps(record, indent=1), encoding="utf-8")
        render()
    print(json.dumps(record) if args.json else "\n".join(report_lines(record)))
