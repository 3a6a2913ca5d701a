"""Reported epsilon versus the one-run audit's lower bound (Steinke, Nasr & Jagielski 2023) for correct runs and
for the TEST-ONLY broken controls (a tenth of the noise the accountant assumes; a clipper that clips to 10 C).

Rows: the white-box linear setting (2000 Dirac gradient canaries added after clipping, on weights the data never
moves) for Gaussian and LAP2 noise at target epsilon 1, 4, 8, each correct and with a tenth of the noise, and at
epsilon 2 and 4 with the clipper at 10 C; the digits CNN with 2000 gradient canaries in random coordinates (the real
gradients share those coordinates) for Gaussian noise; 2000 clipped gradient canaries (canary examples of gradient
norm 10 C that the run's clipper clips) at epsilon 2 and 4, correct, clipper at 10 C and a tenth of the noise, and
LAP2 at epsilon 2; and input canaries on the linear setting (200 mislabelled examples; 200 orthogonal ones on
unused features), scored by their loss decrease, correct and under both controls at epsilon 2. Every run is
seeded, 95 % confidence, delta 1e-5.

Usage: ``nice -n 15 python bench/audit.py [--out docs/audit.md]`` replaces the table between the
``<!-- audit-table -->`` markers of ``--out`` (prints it when the file has no markers).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from lightning_dp.audit import AuditConfig, one_run_epsilon_lower_bound, run_audit
from lightning_dp.audit.one_run import default_guess_sets
from lightning_dp.utils.help_format import HelpFormatter

START, END = "<!-- audit-table:start -->", "<!-- audit-table:end -->"


def configs() -> list[tuple[str, AuditConfig]]:
    rows = []
    for noise in ("gaussian", "lap2"):
        for epsilon in (1.0, 4.0, 8.0):
            for factor in (None, 0.1):
                config = AuditConfig(
                    noise=noise, target_epsilon=epsilon, num_canaries=2000, noise_factor_for_testing=factor
                )
                rows.append(("linear, white-box", config))
    for epsilon, factor in ((1.0, None), (4.0, None), (8.0, None), (4.0, 0.1)):
        config = AuditConfig(
            setup="digits", target_epsilon=epsilon, num_canaries=2000, batch_size=128, noise_factor_for_testing=factor
        )
        rows.append(("digits CNN", config))
    for epsilon in (2.0, 4.0):
        config = AuditConfig(target_epsilon=epsilon, num_canaries=2000, clipping_factor_for_testing=10.0)
        rows.append(("linear, white-box", config))
    clipped = "linear, clipped canaries"
    for epsilon in (2.0, 4.0):
        for broken in ({}, {"clipping_factor_for_testing": 10.0}, {"noise_factor_for_testing": 0.1}):
            config = AuditConfig(mode="clipped-gradient", target_epsilon=epsilon, num_canaries=2000, **broken)
            rows.append((clipped, config))
    for broken in ({}, {"clipping_factor_for_testing": 10.0}):
        config = AuditConfig(mode="clipped-gradient", noise="lap2", target_epsilon=2.0, num_canaries=2000, **broken)
        rows.append((clipped, config))
    mislabelled = "linear, input canaries (mislabelled)"
    rows.append((mislabelled, AuditConfig(mode="input", target_epsilon=8.0, num_canaries=200)))
    for broken in ({}, {"noise_factor_for_testing": 0.1}, {"clipping_factor_for_testing": 10.0}):
        rows.append((mislabelled, AuditConfig(mode="input", target_epsilon=2.0, num_canaries=200, **broken)))
    for broken in ({}, {"noise_factor_for_testing": 0.1}, {"clipping_factor_for_testing": 10.0}):
        orthogonal = dict(mode="input", input_candidates="orthogonal", target_epsilon=2.0, num_canaries=200)
        rows.append(("linear, input canaries (orthogonal)", AuditConfig(**orthogonal, **broken)))
    return rows


def run_label(config: AuditConfig) -> str:
    """``correct``, or which TEST-ONLY control breaks the run."""
    broken = []
    if config.noise_factor_for_testing is not None:
        broken.append(f"noise x{config.noise_factor_for_testing:g}")
    if config.clipping_factor_for_testing is not None:
        broken.append(f"clipping to {config.clipping_factor_for_testing:g} C")
    return f"BROKEN ({', '.join(broken)})" if broken else "correct"


def ceiling(config: AuditConfig) -> float:
    """The largest bound these canaries can give: every guess of the largest default guess set right."""
    sets = default_guess_sets(config.num_canaries)
    r = sum(max(sets))
    confidence = 1 - (1 - config.confidence) / len(sets)
    return one_run_epsilon_lower_bound(config.num_canaries, r, r, delta=config.target_delta, confidence=confidence)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/audit.md"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    lines = [
        "| setting | noise | clipping | run | m | steps | reported eps | audited lower bound (95 %) | "
        "guesses (correct) | ceiling | verdict | time (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for setting, config in configs():
        start = time.perf_counter()
        report = run_audit(config)
        seconds = time.perf_counter() - start
        run = run_label(config)
        verdict = "**bound > reported**" if report.violated else "bound < reported"
        audit = report.audit
        lines.append(
            f"| {setting} | {report.noise} | {report.clipping} | {run} | {audit.num_canaries} | {report.steps} | "
            f"{report.reported_epsilon:.3f} | {audit.epsilon_lower_bound:.3f} | {audit.guesses} ({audit.correct}) | "
            f"{ceiling(config):.2f} | {verdict} | {seconds:.0f} |"
        )
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    text = args.out.read_text() if args.out.exists() else ""
    if START in text and END in text:
        head, rest = text.split(START, 1)
        args.out.write_text(f"{head}{START}\n{table}\n{END}{rest.split(END, 1)[1]}")
    else:
        print(table)


if __name__ == "__main__":
    main()
