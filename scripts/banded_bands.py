"""Render docs/correlated_noise.md's tables for choosing the band: per band ``b``, the calibrated noise multiplier, the
strategy's largest column norm and the expected total squared error of the prefix sums relative to DP-SGD's; with
``--blt D``, the same error for BLT noise with ``D`` buffers against DP-SGD at several target epsilons.

    python scripts/banded_bands.py                         # compute and render between the page's bands markers
    python scripts/banded_bands.py --steps 150 --sample-rate 0.1017 --bands 1 2 4 8 --marker bands-digits
    python scripts/banded_bands.py --steps 10000 --sample-rate 0.001 --blt 4 --marker blt-10-epochs
    python scripts/banded_bands.py --print                 # print the table only

For ``n`` steps at rate ``q``, target epsilon and delta: the strategy ``optimize_banded(n, b,
max_participations=1)`` (the amplified case), ``sigma`` from ``calibrate_banded_mf_noise`` (noise on ``C x``, clip-norm
units), ``s`` the strategy's largest column norm, and the error ``sigma^2 ||A C^-1||_F^2`` for the prefix-sum workload
``A`` (``strategy_error``) over DP-SGD's (``b = 1``). Everything is computed, nothing measured: the same command gives
the same table. BLT: the run's plan (``plan_correlation('blt', ...)``: ``b = floor(1 / q)`` groups, the strategy
``optimize_blt(n, d, min_sep=b)``, its scale ``s = sens / sqrt(k)``), ``sigma`` calibrated by the ``blt-minsep``
accountant (no amplification), the error ``(sigma s)^2 ||A C^-1||_F^2``, over DP-SGD's at the same epsilon.
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "correlated_noise.md"
MARKER = "bands"
BANDS = (1, 2, 4, 8, 16, 32)


def table(steps: int, sample_rate: float, target_epsilon: float, target_delta: float, bands: tuple[int, ...]) -> str:
    """The markdown table (see the module docstring)."""
    from lightning_dp.accounting.banded_mf import band_and_max_column_norm
    from lightning_dp.correlated_noise.optimize import optimize_banded, strategy_error
    from lightning_dp.correlated_noise.workloads import Workload
    from lightning_dp.mechanisms.calibration_banded import calibrate_banded_mf_noise

    rows, baseline = [], None
    for band in bands:
        strategy = optimize_banded(steps, band, max_participations=1)
        rate = band * sample_rate
        sigma, _ = calibrate_banded_mf_noise(
            strategy, steps=steps, group_sample_rate=rate, target_epsilon=target_epsilon, target_delta=target_delta
        )
        _, norm = band_and_max_column_norm(strategy, steps)
        error = sigma**2 * strategy_error(strategy, Workload(steps))
        baseline = error if baseline is None else baseline
        rows.append(
            f"| {band} | {rate:.3g} | {sigma / norm:.3f} | {norm:.3f} | {math.ceil(steps / band)} | "
            f"{error / baseline:.3f} |"
        )
    return "\n".join(
        [
            "| b | q_b = b q | sigma / s (DP-SGD's at q_b, k steps) | s | k = ceil(n / b) | total squared error / "
            "DP-SGD's |",
            "|---|---|---|---|---|---|",
            *rows,
        ]
    )


def blt_table(steps: int, sample_rate: float, epsilons: tuple[float, ...], target_delta: float, buffers: int) -> str:
    """The markdown table of BLT noise against DP-SGD (see the module docstring), one row per target epsilon."""
    from lightning_dp.correlated_noise.optimize import strategy_error
    from lightning_dp.correlated_noise.strategies import BandedToeplitz
    from lightning_dp.correlated_noise.workloads import Workload
    from lightning_dp.engine.correlation import plan_correlation
    from lightning_dp.mechanisms.calibration_banded import calibrate_banded_mf_noise

    workload = Workload(steps)
    identity = BandedToeplitz((1.0,))
    plan = plan_correlation(
        "blt", band=None, buffers=buffers, sample_rate=sample_rate, planned_steps=steps, restored=None, segment=0
    )
    rows = []
    for epsilon in epsilons:
        dp_sgd, _ = calibrate_banded_mf_noise(
            identity, steps=steps, group_sample_rate=sample_rate, target_epsilon=epsilon, target_delta=target_delta
        )
        sigma = plan.calibrate(target_epsilon=epsilon, target_delta=target_delta, max_grad_norm=1.0).noise_multiplier
        ratio = (
            (sigma * plan.scale) ** 2
            * strategy_error(plan.strategy, workload)
            / (dp_sgd**2 * strategy_error(identity, workload))
        )
        rows.append(f"| {epsilon:g} | {dp_sgd:.3f} | {sigma:.3f} | {ratio:.3f} |")
    return "\n".join(
        [
            f"| epsilon | DP-SGD's sigma (q = {sample_rate:g}, n = {steps}) | BLT's sigma (b = {plan.num_groups}, k = "
            f"{plan.participations} unamplified steps, d = {buffers}) | total squared error / DP-SGD's |",
            "|---|---|---|---|",
            *rows,
        ]
    )


def markers(name: str) -> tuple[str, str]:
    """The page's lines around the table ``name``."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def render(text: str, command: str, marker: str = MARKER) -> None:
    """Put the command and ``text`` between the page's markers ``marker``."""
    start, end = markers(marker)
    content = PAGE.read_text(encoding="utf-8")
    if start not in content or end not in content:
        raise ValueError(f"{PAGE} lacks the lines {start} and {end}")
    before, rest = content.split(start, 1)
    after = rest.split(end, 1)[1]
    block = f"```bash\n{command}\n```\n\n{text}"
    PAGE.write_text(f"{before}{start}\n{block}\n{end}{after}", encoding="utf-8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--sample-rate", type=float, default=0.01)
    parser.add_argument("--target-epsilon", type=float, default=3.0)
    parser.add_argument("--target-delta", type=float, default=1e-5)
    parser.add_argument("--bands", type=int, nargs="+", default=list(BANDS))
    parser.add_argument("--blt", type=int, metavar="D", help="compare BLT noise with D buffers to DP-SGD instead")
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0, 8.0], help="with --blt")
    parser.add_argument("--marker", default=MARKER, help="the page's markers to render between (default bands)")
    parser.add_argument("--print", action="store_true", help="print the table; do not render the page")
    return parser.parse_args(argv)


def table_of(args: argparse.Namespace) -> str:
    """:func:`table` (or, with ``--blt``, :func:`blt_table`) for parsed arguments."""
    if args.blt is not None:
        return blt_table(args.steps, args.sample_rate, tuple(args.epsilons), args.target_delta, args.blt)
    return table(args.steps, args.sample_rate, args.target_epsilon, args.target_delta, tuple(args.bands))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    text = table_of(args)
    if args.print:
        print(text)
        return
    arguments = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--print"]
    render(text, shlex.join(["python", "scripts/banded_bands.py", *arguments]), args.marker)
    print(text)


if __name__ == "__main__":
    main()
