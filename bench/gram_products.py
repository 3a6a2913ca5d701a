"""CPU time of a long use's Gram matrix per sample, ``x_b x_b^T`` for a factor ``x`` ``[B, T, n]``, on each path of
``ghost.self_product`` (docs/design.md section 12.6): one triangle from BLAS's symmetric product
(``symmetric_gram.triangle_gram``, the CPU's path where ``ghost.uses_triangles``), two ``bmm`` panels (a GPU's path,
and the CPU's below ``ghost.TRIANGLE_ROWS`` rows and ``ghost.TRIANGLE_WIDTH`` columns) and the whole ``bmm`` product
(below ``ghost.LONG_ROWS`` rows). What those two thresholds are set from.

    python bench/gram_products.py --record epyc512    # measure, then render docs/performance.md
    python bench/gram_products.py --render            # only re-render from docs/bench/gram_products/*.json

For each shape ``B x T x n`` (``--shapes``), one float32 factor of standard normals; each of ``--rounds`` rounds
times every path once, in an order that rotates every round, by the process's CPU time with ``--threads`` intra-op
threads (BLAS gets as many). Reported per shape: the median over the rounds of each path's milliseconds, and the
triangle's and the panels' ratio to the whole product (each ratio's median over the rounds).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from records import add_record_options, render_records, run_or_render

from lightning_dp.clipping.engines import ghost
from lightning_dp.clipping.symmetric_gram import triangle_gram
from lightning_dp.clipping.terms import Factored
from lightning_dp.utils.help_format import HelpFormatter

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "bench" / "gram_products"
PAGE = ROOT / "docs" / "performance.md"
START, END = "<!-- gram_products:start -->", "<!-- gram_products:end -->"
DEFAULT_SHAPES = [f"8x{t}x{n}" for t in (128, 256, 512) for n in (64, 256, 1024, 4096, 16384, 50257)]


def panels(x: torch.Tensor) -> None:
    """The two panels of ``ghost`` for one factor: the lower-right block and the first ``T // 2`` columns."""
    h = x.shape[1] // 2
    torch.bmm(x[:, h:], x[:, h:].transpose(1, 2))
    torch.bmm(x, x[:, :h].transpose(1, 2))


def whole(x: torch.Tensor) -> None:
    """The whole product, both triangles."""
    torch.bmm(x, x.transpose(1, 2))


PATHS: dict[str, Callable[[torch.Tensor], Any]] = {"triangle": triangle_gram, "panels": panels, "whole": whole}


def _shape(text: str) -> tuple[int, int, int]:
    batch, rows, width = (int(part) for part in text.split("x"))
    return batch, rows, width


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Per shape: each path's CPU milliseconds per round (``ms``) and the per-round ratios to the whole product."""
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    shapes = []
    for text in args.shapes:
        x = torch.randn(*_shape(text), generator=generator)
        for path in PATHS.values():  # one untimed call each: allocations, BLAS's threads
            path(x)
        ms: dict[str, list[float]] = {name: [] for name in PATHS}
        names = list(PATHS)
        for round_ in range(args.rounds):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                start = time.process_time()
                PATHS[name](x)
                ms[name].append((time.process_time() - start) * 1e3)
        shapes.append({"shape": text, "ms": ms})
        del x
    return {"shapes": shapes, "threads": args.threads, "rounds": args.rounds}


def markdown(record: dict[str, Any]) -> str:
    """A record as docs/performance.md shows it: the command, then a row per shape."""
    env = record["environment"]
    lines = [
        f"**Gram matrices of one factor** ({env['device_name']}, {env.get('cpu_capability', '?')} kernels, torch "
        f"{env['torch']}, {record['threads']} intra-op thread(s), {record['rounds']} rounds, load average "
        f"{env['load_before']:.2f} before / {env['load_after']:.2f} after; CPU ms, median over the rounds)",
        "",
        "```bash",
        record["command"],
        "```",
        "",
        "| B x T x n | triangle | panels | whole | triangle / whole | panels / whole | the CPU takes |",
        "|---|---|---|---|---|---|---|",
    ]
    for shape in record["shapes"]:
        ms = shape["ms"]
        median = {name: statistics.median(values) for name, values in ms.items()}
        ratio = {
            name: statistics.median(a / b for a, b in zip(ms[name], ms["whole"], strict=True))
            for name in ("triangle", "panels")
        }
        lines.append(
            f"| {shape['shape']} | {median['triangle']:.3g} | {median['panels']:.3g} | {median['whole']:.3g} "
            f"| {ratio['triangle']:.2f} | {ratio['panels']:.2f} | {_cpu_path(_shape(shape['shape']))} |"
        )
    return "\n".join(lines)


def _cpu_path(shape: tuple[int, int, int]) -> str:
    """The path ``ghost.self_product`` takes on the CPU for a use whose factors are both ``shape``."""
    factor = torch.zeros(()).expand(shape)  # no memory: the choice reads the shape, dtype and device only
    if ghost.uses_triangles(Factored(factor, factor, torch.Size((shape[2], shape[2])))):
        return "triangle"
    return "panels" if shape[1] >= ghost.LONG_ROWS else "whole"


def render() -> None:
    render_records(RECORDS, markdown, PAGE, START, END)


def report_lines(record: dict[str, Any]) -> list[str]:
    return markdown(record).splitlines()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, metavar="BxTxn", help="factor shapes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (default 1)")
    add_record_options(parser, RECORDS)
    args = parser.parse_args()
    run_or_render(args, measure, render, script="bench/gram_products.py", records=RECORDS, report_lines=report_lines)


if __name__ == "__main__":
    main()
