"""``lightning-dp epsilon`` and ``lightning-dp calibrate``: privacy accounting from the command line.

``epsilon`` reports the epsilon of ``T`` Poisson-subsampled steps of a noise mechanism; for ``lap2`` and ``plrv``
(and ``laplace-advanced``) it shows the paper's accountant next to the sound default (DESIGN.md section 6), unless
``--accountant`` names one. ``calibrate`` finds the noise parameters for a target epsilon (and, with ``--search``,
runs LAP2 / PLRV-O Alg. 1 over the clipping bound). With ``--clipping hutch|hutchpp`` (randomized clipping, seed
``dpsgd-rc``; Gaussian noise only) both use the ``rc`` accountant with ``--projection-dim`` and ``--norm-dim``.
Readable output is an aligned table; ``--json`` prints
exactly one JSON object on stdout. Both return a process exit code (0 success, 2 usage or invalid values).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from lightning_dp.accounting.rc_envelope import ESTIMATORS
from lightning_dp.mechanisms import MECHANISMS, NoiseMechanism, make_mechanism
from lightning_dp.mechanisms.calibration import (
    calibrate_result,
    mechanism_epsilon,
    resolve_accountant,
    search_lap2,
    search_plrv,
)
from lightning_dp.mechanisms.calibration_rc import calibrate_randomized_clipping, randomized_clipping_epsilon

NOISES = ("gaussian", "laplace", "laplace-advanced", "lap2", "plrv")

#: Accountants shown side by side when the user names none: the paper's bound first, the sound default last.
COMPARISONS: dict[str, tuple[str, ...]] = {
    "laplace-advanced": ("advanced", "lap2"),
    "lap2": ("lap2-paper", "lap2"),
    "plrv": ("plrv-paper", "plrv"),
}

NOTES: dict[str, str] = {
    "lap2-paper": "paper bound (eq. III.7), not valid for the subsampled mechanism",
    "plrv-paper": "paper bound (Alg. 2), not valid for the subsampled mechanism",
    "advanced": "advanced composition (literature review 4.3)",
}


def format_table(rows: list[tuple[str, ...]]) -> str:
    """Left-aligned plain-text columns separated by two spaces (one line per row)."""
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(max(len(r) for r in rows))]
    return "\n".join("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows)


def _fmt(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--noise", required=True, choices=NOISES, help="noise mechanism")
    parser.add_argument("--sample-rate", type=float, required=True, help="Poisson rate q = batch size / N")
    parser.add_argument("--steps", type=int, required=True, help="number of optimizer steps T")
    parser.add_argument("--delta", type=float, required=True, help="target delta (below 1/N)")
    parser.add_argument("--num-params", type=int, help="noised coordinates n (lap2, laplace-advanced, plrv)")
    parser.add_argument("--accountant", help="accountant name (default: the mechanism's sound accountant)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument(
        "--clipping", choices=ESTIMATORS, help="randomized clipping (Hutch / Hutch++ norm estimates): rc accountant"
    )
    parser.add_argument("--projection-dim", type=int, default=32, help="k, projection columns (default 32)")
    parser.add_argument("--norm-dim", type=int, help="d, the widest estimated layer's min(p, d) (with --clipping)")


def _randomized_clipping(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any] | None:
    """The ``rc`` arguments ``{projection_dim, norm_dim, estimator}`` when ``--clipping`` is given, else None."""
    if args.clipping is None:
        return None
    if args.noise != "gaussian":
        parser.error(f"--clipping {args.clipping} is accounted for Gaussian noise only (got --noise {args.noise})")
    if args.accountant not in (None, "rc"):
        parser.error(f"--clipping {args.clipping} uses the rc accountant (got --accountant {args.accountant})")
    if args.norm_dim is None:
        parser.error(f"--clipping {args.clipping} needs --norm-dim D (the widest estimated layer's min(p, d))")
    return {"projection_dim": args.projection_dim, "norm_dim": args.norm_dim, "estimator": args.clipping}


def _epsilons(mechanism: NoiseMechanism, accountants: tuple[str, ...], args: argparse.Namespace) -> dict[str, float]:
    return {
        name: mechanism_epsilon(
            mechanism,
            sample_rate=args.sample_rate,
            steps=args.steps,
            delta=args.delta,
            num_params=args.num_params,
            accountant=name,
        )
        for name in accountants
    }


def _emit(summary: dict[str, Any], epsilons: dict[str, float], as_json: bool, default: str) -> None:
    if as_json:
        print(json.dumps({**summary, "epsilons": epsilons}))
        return
    rows = [
        (key, _fmt(value))
        for key, value in summary.items()
        if key not in ("epsilon", "accountant") and value is not None
    ]
    table = [("accountant", "epsilon", "note")]
    for name, eps in epsilons.items():
        table.append((name, _fmt(eps), NOTES.get(name, "sound (default)" if name == default else "")))
    print(format_table(rows))
    print()
    print(format_table(table))


def _run(
    parser: argparse.ArgumentParser,
    argv: list[str],
    body: Callable[[argparse.ArgumentParser, argparse.Namespace], None],
) -> int:
    """Parse ``argv``, run ``body``; a ``ValueError`` (invalid values) becomes a message on stderr and exit code 2."""
    args = parser.parse_args(argv)
    try:
        body(parser, args)
    except ValueError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    return 0


def _summary(
    args: argparse.Namespace, mechanism: NoiseMechanism, epsilon: float, accountant: str, **extra: float
) -> dict[str, Any]:
    """The result object both subcommands print (``extra`` goes after the accountant, e.g. the target)."""
    return {
        "noise": args.noise,
        "epsilon": epsilon,
        "delta": args.delta,
        "accountant": accountant,
        **extra,
        "sample_rate": args.sample_rate,
        "steps": args.steps,
        **mechanism.describe(),
        "num_params": args.num_params,
        "clipping": args.clipping,
        "projection_dim": args.projection_dim if args.clipping else None,
        "norm_dim": args.norm_dim,
        "expected_abs_noise": mechanism.expected_abs_noise(),
    }


def _epsilon_body(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    required = {
        "gaussian": ("noise_multiplier",),
        "laplace": ("noise_scale",),
        "laplace-advanced": ("noise_scale",),
        "lap2": ("noise_scale",),
        "plrv": ("gamma_shape", "gamma_scale"),
    }[args.noise]
    missing = [f"--{p.replace('_', '-')}" for p in required if getattr(args, p) is None]
    if missing:
        parser.error(f"--noise {args.noise} needs {' and '.join(missing)}")
    params = {p: getattr(args, p) for p in required}
    mechanism = make_mechanism(args.noise, max_grad_norm=args.max_grad_norm, **params)
    rc = _randomized_clipping(parser, args)
    if rc is not None:
        schedule = {"target_delta": args.delta, "sample_rate": args.sample_rate, "steps": args.steps}
        epsilon = randomized_clipping_epsilon(args.noise_multiplier, **schedule, **rc)
        _emit(_summary(args, mechanism, epsilon, "rc"), {"rc": epsilon}, args.json, "rc")
        return
    default = MECHANISMS[args.noise].default_accountant
    accountants = (args.accountant,) if args.accountant else COMPARISONS.get(args.noise, (default,))
    epsilons = _epsilons(mechanism, accountants, args)
    primary = args.accountant or default
    _emit(_summary(args, mechanism, epsilons[primary], primary), epsilons, args.json, default)


def epsilon_main(argv: list[str]) -> int:
    """``lightning-dp epsilon``: epsilon after ``--steps`` steps of the given mechanism at ``--delta``."""
    parser = argparse.ArgumentParser(prog="lightning-dp epsilon", description=epsilon_main.__doc__)
    _common_arguments(parser)
    parser.add_argument("--max-grad-norm", type=float, required=True, help="clipping bound C")
    parser.add_argument("--noise-multiplier", type=float, help="Gaussian sigma (noise std = sigma * C)")
    parser.add_argument("--noise-scale", type=float, help="Laplace scale b (laplace, laplace-advanced, lap2)")
    parser.add_argument("--gamma-shape", type=float, help="PLRV-O Gamma shape k > 1")
    parser.add_argument("--gamma-scale", type=float, help="PLRV-O Gamma scale theta > 0")
    return _run(parser, argv, _epsilon_body)


def _calibrate_body(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    target = {"target_epsilon": args.target_epsilon, "target_delta": args.delta}
    schedule = {"sample_rate": args.sample_rate, "steps": args.steps}
    if args.search and args.noise not in ("lap2", "plrv"):
        parser.error("--search is only defined for --noise lap2 (LAP2 Alg. 1) and --noise plrv (PLRV-O Alg. 1)")
    if args.search and args.num_params is None:
        parser.error(f"--search with --noise {args.noise} needs --num-params")
    rc = _randomized_clipping(parser, args)
    if rc is not None:
        if args.search:
            parser.error("--search is not defined with --clipping")
        result = calibrate_randomized_clipping(**target, **schedule, **rc, max_grad_norm=args.max_grad_norm)
        summary = _summary(args, result.mechanism, result.epsilon, "rc", target_epsilon=args.target_epsilon)
        _emit(summary, {"rc": result.epsilon}, args.json, "rc")
        return
    accountant = resolve_accountant(args.noise, args.accountant)
    if args.search and args.noise == "lap2":
        found = search_lap2(
            **target, **schedule, num_params=args.num_params, accountant=accountant, max_clip=args.max_grad_norm
        )
        mechanism, epsilon = found.mechanism(), found.epsilon
    elif args.search:
        found = search_plrv(
            **target,
            **schedule,
            num_params=args.num_params,
            accountant=accountant,
            clip_range=(args.max_grad_norm / 2, args.max_grad_norm),
        )
        mechanism, epsilon = found.mechanism(), found.epsilon
    else:
        result = calibrate_result(
            args.noise,
            **target,
            **schedule,
            max_grad_norm=args.max_grad_norm,
            num_params=args.num_params,
            accountant=accountant,
        )
        mechanism, epsilon = result.mechanism, result.epsilon
    default = MECHANISMS[args.noise].default_accountant
    epsilons = {accountant: epsilon}
    if default != accountant:  # e.g. laplace-advanced calibrated by "advanced": also show the sound bound
        epsilons.update(_epsilons(mechanism, (default,), args))
    summary = _summary(args, mechanism, epsilon, accountant, target_epsilon=args.target_epsilon)
    _emit(summary, epsilons, args.json, default)


def calibrate_main(argv: list[str]) -> int:
    """``lightning-dp calibrate``: noise parameters that reach ``--target-epsilon`` at ``--delta``."""
    parser = argparse.ArgumentParser(prog="lightning-dp calibrate", description=calibrate_main.__doc__)
    _common_arguments(parser)
    parser.add_argument("--target-epsilon", type=float, required=True, help="target epsilon")
    parser.add_argument(
        "--max-grad-norm",
        type=float,
        default=1.0,
        help="clipping bound C (with --search: the largest C considered); default 1.0",
    )
    parser.add_argument(
        "--search", action="store_true", help="lap2/plrv: also search the clipping bound (LAP2 / PLRV-O Alg. 1)"
    )
    return _run(parser, argv, _calibrate_body)
