"""CPU time (user + system, seconds) of the command line's everyday calls, each in a fresh interpreter.

Usage: ``python bench/cli_startup.py [--repeats 5]``. Each call runs ``--repeats`` times; the table shows the
fastest and the median run (on a shared machine the fastest is the one least disturbed by the neighbours) next to
the target, with ``import torch`` as the yardstick. The calls go through ``lightning_dp.cli.main:main`` as the
``lightning-dp`` console script does, without its launcher. ``tests/structure/test_lazy_imports.py`` checks the imports
that keep these low.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import sys
from pathlib import Path

from lightning_dp.utils.help_format import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
CLI = "from lightning_dp.cli.main import main; raise SystemExit(main())"
GAUSS = "--noise gaussian --sample-rate 0.01 --steps 1000 --delta 1e-5 --max-grad-norm 1"
#: label -> (Python code, its arguments, target CPU seconds or None).
CALLS: dict[str, tuple[str, list[str], float | None]] = {
    "import torch": ("import torch", [], None),
    "import lightning_dp": ("import lightning_dp", [], None),
    "lightning-dp --help": (CLI, ["--help"], 1.5),
    "lightning-dp epsilon --help": (CLI, ["epsilon", "--help"], 1.5),
    "lightning-dp epsilon --noise gausian": (CLI, ["epsilon", "--noise", "gausian"], 1.5),
    "lightning-dp epsilon (Gaussian, sigma 1.1)": (CLI, ["epsilon", *GAUSS.split(), "--noise-multiplier", "1.1"], 3.0),
    "lightning-dp calibrate (Gaussian, epsilon 3)": (CLI, ["calibrate", *GAUSS.split(), "--target-epsilon", "3"], None),
    "lightning-dp demo --help": (CLI, ["demo", "--help"], 1.5),
}


def cpu_seconds(code: str, argv: list[str]) -> float:
    """User + system CPU time of ``python -c code *argv`` (its output discarded)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="runs of each call (default: 5)")
    args = parser.parse_args()
    width = max(map(len, CALLS))
    print(f"{'call':<{width}}  {'fastest [s]':>11}  {'median [s]':>10}  {'target [s]':>10}")
    for label, (code, argv, target) in CALLS.items():
        times = [cpu_seconds(code, argv) for _ in range(args.repeats)]
        verdict = "" if target is None else f"{target:>10.1f}  {'ok' if min(times) < target else 'OVER'}"
        print(f"{label:<{width}}  {min(times):>11.2f}  {statistics.median(times):>10.2f}  {verdict}")


if __name__ == "__main__":
    main()
