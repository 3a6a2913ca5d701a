"""``lightning-dp audit``: train once with canaries and print an empirical epsilon lower bound next to the reported
epsilon (Steinke, Nasr & Jagielski 2023; docs/audit.md). Modes: ``gradient`` (Dirac canaries after clipping),
``clipped-gradient`` (canaries of norm ``--canary-norm`` times C, clipped), ``input`` (candidate examples). ``--json``
prints one JSON object. Exit code 0: bound below the reported epsilon; 1: above it; 2: usage or invalid values.
"""

from __future__ import annotations

import argparse
import json
import logging

from lightning_dp.audit import AuditConfig, run_audit
from lightning_dp.audit.runner import MODES
from lightning_dp.audit.setups import INPUT_CANDIDATES, SETUPS
from lightning_dp.cli.args import Parser, choice, metavar_of
from lightning_dp.cli.privacy import _fmt, format_table, noises
from lightning_dp.clipping import AUTO, clipping_choices


def _audit_body(args: argparse.Namespace) -> bool:
    """Run the audit, print it, return whether the bound exceeds the reported epsilon."""
    config = AuditConfig(
        setup=args.setup,
        mode=args.mode,
        noise=args.noise,
        clipping=args.clipping,
        target_epsilon=args.target_epsilon,
        target_delta=args.delta,
        num_canaries=args.canaries,
        epochs=args.epochs,
        batch_size=args.batch_size,
        max_grad_norm=args.max_grad_norm,
        canary_norm=args.canary_norm,
        input_candidates=args.input_candidates,
        confidence=args.confidence,
        seed=args.seed,
    )
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    report = run_audit(config)
    if args.json:
        print(json.dumps(report.as_dict()))
        return report.violated
    rows = [(key, _fmt(value)) for key, value in report.as_dict().items()]
    print(format_table(rows))
    verdict = "EXCEEDS" if report.violated else "stays below"
    print(
        f"\nAt {report.audit.confidence:.0%} confidence the audited lower bound {report.audit.epsilon_lower_bound:.3f} "
        f"{verdict} the reported epsilon {report.reported_epsilon:.3f}."
    )
    return report.violated


def audit_main(argv: list[str]) -> int:
    """``lightning-dp audit [--setup linear|digits] [--mode gradient|clipped-gradient|input] --noise N
    --target-epsilon E ...``; returns the exit code."""
    parser = Parser("lightning-dp audit", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--setup",
        default="linear",
        type=choice(SETUPS),
        metavar=metavar_of(SETUPS),
        help="linear (white-box, fast) or digits CNN",
    )
    parser.add_argument(
        "--mode",
        default="gradient",
        type=choice(MODES),
        metavar=metavar_of(MODES),
        help="canary type: gradient (added after clipping), clipped-gradient (clipped by the run), input",
    )
    names = noises()
    parser.add_argument("--noise", default="gaussian", type=choice(names), metavar=metavar_of(names), help="noise")
    engines = clipping_choices()
    parser.add_argument(
        "--clipping",
        default=AUTO,
        type=choice(engines),
        metavar=metavar_of(engines),
        help="per-sample clipping engine (default auto: mixed for l2 noise, flat for laplace)",
    )
    parser.add_argument("--target-epsilon", type=float, required=True, help="epsilon the noise is calibrated for")
    parser.add_argument("--delta", type=float, default=1e-5, help="target delta (default 1e-5)")
    parser.add_argument("--canaries", type=int, default=1000, help="number of canaries m (default 1000)")
    parser.add_argument("--epochs", type=int, default=10, help="training epochs (default 10)")
    parser.add_argument("--batch-size", type=int, default=100, help="expected Poisson batch size (default 100)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="clipping bound C (default 1)")
    parser.add_argument(
        "--canary-norm",
        type=float,
        default=10.0,
        help="clipped-gradient canaries' gradient norm in units of C, > 1 (default 10)",
    )
    parser.add_argument(
        "--input-candidates",
        default="mislabelled",
        type=choice(INPUT_CANDIDATES),
        metavar=metavar_of(INPUT_CANDIDATES),
        help="input canaries: mislabelled data points or orthogonal ones on unused features (default mislabelled)",
    )
    parser.add_argument("--confidence", type=float, default=0.95, help="confidence of the bound (default 0.95)")
    parser.add_argument("--seed", type=int, default=0, help="seed of data, weights, noise and canaries")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    args = parser.parse_args(argv)
    return 1 if _audit_body(args) else 0  # a ValueError becomes one error line (exit 2) in cli.main
