"""The correlated-noise options of ``lightning-dp epsilon`` and ``calibrate`` (``--noise-correlation``,
``--correlation-band``, ``--correlation-buffers``): their arguments, their checks and the run's plan they describe
(:mod:`lightning_dp.engine.correlation`, imported only when correlated noise is asked for: it needs torch)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from lightning_dp.cli.args import choice, metavar_of, positive_int
from lightning_dp.correlated_noise.kinds import CORRELATION_ACCOUNTANTS, DEFAULT_BLT_BUFFERS, NOISE_CORRELATIONS

if TYPE_CHECKING:
    from lightning_dp.engine.correlation import CorrelationPlan

#: The ``--noise-correlation`` values (``None``, independent noise, is the option's absence).
CORRELATIONS = tuple(name for name in NOISE_CORRELATIONS if name is not None)


def add_correlation_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--noise-correlation``, ``--correlation-band`` and ``--correlation-buffers`` to ``parser``."""
    parser.add_argument(
        "--noise-correlation",
        type=choice(CORRELATIONS),
        metavar=metavar_of(CORRELATIONS),
        help="correlated noise, Gaussian only, with the strategy a run of --steps planned steps optimises: banded "
        "(banded-mf accountant, cyclic Poisson over --correlation-band groups) or blt (blt-minsep accountant, "
        "floor(1/q) cyclic groups, no amplification)",
    )
    parser.add_argument(
        "--correlation-band",
        type=positive_int,
        help="b, the band and number of cyclic groups (with --noise-correlation banded)",
    )
    parser.add_argument(
        "--correlation-buffers",
        type=positive_int,
        help=f"d, the buffers of --noise-correlation blt (default {DEFAULT_BLT_BUFFERS})",
    )


def correlation_plan(parser: argparse.ArgumentParser, args: argparse.Namespace) -> CorrelationPlan | None:
    """The run's :class:`~lightning_dp.engine.correlation.CorrelationPlan` when ``--noise-correlation`` is given, else
    None (its options alone, other noises, accountants or ``--clipping``: a usage error)."""
    kind = args.noise_correlation
    if args.correlation_band is not None and kind != "banded":
        parser.error(
            "--correlation-band applies to --noise-correlation banded; "
            + ("set that too" if kind is None else f"remove it with --noise-correlation {kind}")
        )
    if args.correlation_buffers is not None and kind != "blt":
        parser.error(
            "--correlation-buffers applies to --noise-correlation blt; "
            + ("set that too" if kind is None else f"remove it with --noise-correlation {kind}")
        )
    if kind is None:
        for name, accountant in CORRELATION_ACCOUNTANTS.items():
            if args.accountant == accountant:
                parser.error(
                    f"--accountant {accountant} accounts for correlated noise only; add --noise-correlation {name}"
                    + (" --correlation-band B" if name == "banded" else "")
                )
        return None
    accountant = CORRELATION_ACCOUNTANTS[kind]
    if args.noise != "gaussian":
        parser.error(f"--noise-correlation {kind} correlates Gaussian noise (got --noise {args.noise})")
    if args.accountant not in (None, accountant):
        parser.error(
            f"--noise-correlation {kind} is accounted by --accountant {accountant} only (got --accountant "
            f"{args.accountant})"
        )
    if args.clipping is not None:
        parser.error(f"--noise-correlation {kind} is not accounted with --clipping {args.clipping}")
    if kind == "banded" and args.correlation_band is None:
        parser.error("--noise-correlation banded needs --correlation-band B (1 is DP-SGD)")
    if kind == "banded" and args.correlation_band > args.steps:
        parser.error(
            f"--correlation-band {args.correlation_band} exceeds --steps {args.steps}; use a band <= {args.steps}"
        )
    from lightning_dp.engine.correlation import plan_correlation  # torch: only when correlated noise is asked for

    try:
        return plan_correlation(
            kind,
            band=args.correlation_band,
            buffers=args.correlation_buffers or DEFAULT_BLT_BUFFERS,
            sample_rate=args.sample_rate,
            planned_steps=args.steps,
            restored=None,
            segment=0,
        )
    except ValueError as error:  # b q > 1, q outside (0, 1]
        parser.error(str(error))


def correlation_summary(summary: dict[str, Any], plan: CorrelationPlan | None) -> dict[str, Any]:
    """``summary`` with the participation pattern of ``plan`` (its kind's summary, ``k`` and ``s``) after the noise
    rows."""
    if plan is None:
        return summary
    return {
        **summary,
        "expected_abs_noise": None,  # the mechanism's is that of Z_t, not of the correlated (C^-1 Z)_t
        **plan.summary(),
        "participations": plan.participations,
        "noise_scale_factor": plan.scale,
    }
