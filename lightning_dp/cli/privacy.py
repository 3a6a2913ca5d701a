"""``lightning-dp epsilon`` and ``lightning-dp calibrate``: privacy accounting from the command line.

``epsilon``: the epsilon of ``T`` Poisson-subsampled steps (the paper's accountant beside the sound default for
``lap2``, ``plrv``, ``laplace-advanced``; docs/design.md section 6). ``calibrate``: noise parameters for a target
epsilon (``--search``: LAP2 / PLRV-O Alg. 1 over the clipping bound). ``--clipping hutch|hutchpp`` uses the ``rc``
accountant (Gaussian only); ``--noise-correlation banded --correlation-band B`` the ``banded-mf`` accountant of banded
matrix-factorization noise under cyclic Poisson sampling, ``--noise-correlation blt [--correlation-buffers D]`` the
``blt-minsep`` accountant of BLT noise, each with the strategy a run of ``--steps`` planned steps uses (Gaussian
only). ``--json`` prints one JSON object; ``epsilon --plot FILE`` draws the curves. Exit code 0,
or 2 for usage or invalid values (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
from collections.abc import Callable
from typing import Any

from lightning_dp.accounting import ACCOUNTANTS
from lightning_dp.accounting.rc_envelope import ESTIMATORS
from lightning_dp.cli.args import Parser, choice, metavar_of, positive_int
from lightning_dp.cli.correlation_args import add_correlation_arguments, correlation_plan, correlation_summary
from lightning_dp.correlated_noise.kinds import CORRELATION_ACCOUNTANTS
from lightning_dp.mechanisms import MECHANISMS, NoiseMechanism, make_mechanism
from lightning_dp.mechanisms.calibration import calibrate_result, mechanism_epsilon, resolve_accountant
from lightning_dp.mechanisms.calibration_rc import calibrate_randomized_clipping, randomized_clipping_epsilon
from lightning_dp.mechanisms.solver import CalibrationProblem


def noises() -> tuple[str, ...]:
    """The registered mechanism names (read at call time, so a mechanism registered later is offered too)."""
    return tuple(MECHANISMS)


def noise_options(noise: str) -> tuple[str, ...]:
    """The noise-parameter options ``noise`` takes (``epsilon``); any other one given is an error, not ignored."""
    return MECHANISMS[noise].noise_parameters()


def _noise_parameter_help() -> dict[str, str]:
    """Each noise parameter of the registered mechanisms and its help, naming the mechanisms that take it."""
    takers: dict[str, list[str]] = {}
    helps: dict[str, str] = {}
    for name, cls in MECHANISMS.items():
        for param in cls.noise_parameters():
            takers.setdefault(param, []).append(name)
            helps.setdefault(param, cls.parameter_help.get(param, param.replace("_", " ")))
    return {param: f"{helps[param]} ({', '.join(names)})" for param, names in takers.items()}


#: Points of the ``--plot`` curve (each is one accountant evaluation, about a second with PLD); the ``rc``
#: accountant (``--clipping``) is far slower per evaluation, so its curve has fewer.
PLOT_POINTS = 16
RC_PLOT_POINTS = 5


def format_table(rows: list[tuple[str, ...]]) -> str:
    """Left-aligned plain-text columns separated by two spaces (one line per row)."""
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(max(len(r) for r in rows))]
    return "\n".join("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip() for row in rows)


def _fmt(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def _option(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _common_arguments(parser: argparse.ArgumentParser) -> None:
    names = noises()
    parser.add_argument("--noise", required=True, type=choice(names), metavar=metavar_of(names), help="noise mechanism")
    parser.add_argument("--sample-rate", type=float, required=True, help="Poisson rate q = batch size / N, in (0, 1]")
    parser.add_argument("--steps", type=positive_int, required=True, help="number of optimizer steps T")
    parser.add_argument("--delta", type=float, required=True, help="target delta in (0, 1), below 1/N")
    counting = ", ".join(name for name, cls in MECHANISMS.items() if cls.needs_num_params)
    parser.add_argument("--num-params", type=positive_int, help=f"noised coordinates n ({counting})")
    parser.add_argument(
        "--accountant",
        type=choice(ACCOUNTANTS),
        metavar=metavar_of(ACCOUNTANTS),
        help="accountant (default: the mechanism's sound accountant; epsilon also shows the paper's for lap2, plrv)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument(
        "--clipping",
        type=choice(ESTIMATORS),
        metavar=metavar_of(ESTIMATORS),
        help="randomized clipping (Hutch / Hutch++ norm estimates): rc accountant, Gaussian noise only",
    )
    parser.add_argument(
        "--projection-dim", type=positive_int, default=32, help="k, projection columns (with --clipping)"
    )
    parser.add_argument(
        "--norm-dim", type=positive_int, help="d, the widest estimated layer's min(p, d) (required with --clipping)"
    )
    add_correlation_arguments(parser)


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
    if not all(math.isfinite(eps) for eps in epsilons.values()):
        print(
            "lightning-dp: warning: epsilon is infinite (no noise, or noise the accountant cannot bound): no "
            "differential-privacy guarantee",
            file=sys.stderr,
        )
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
        note = ACCOUNTANTS[name].note or ("sound (default)" if name == default else "")
        table.append((name, _fmt(eps), note))
    print(format_table(rows))
    print()
    print(format_table(table))


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


class _OncePerMessage(logging.Filter):
    """Passes each distinct log message once (the paper accountants warn at every construction, and ``--plot``
    builds one per point)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message in self.seen:
            return False
        self.seen.add(message)
        return True


def _epsilon_body(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    once = _OncePerMessage()
    logger = logging.getLogger("lightning_dp")
    logger.addFilter(once)
    try:
        _epsilon_report(parser, args)
    finally:
        logger.removeFilter(once)


def _epsilon_report(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    required = noise_options(args.noise)
    missing = [_option(p) for p in required if getattr(args, p) is None]
    if missing:
        parser.error(f"--noise {args.noise} needs {' and '.join(missing)}")
    others = {p for name in MECHANISMS for p in noise_options(name)} - set(required)
    extra = [_option(p) for p in sorted(others) if getattr(args, p) is not None]
    if extra:
        parser.error(
            f"{' and '.join(extra)} does not apply to --noise {args.noise}, which takes "
            f"{' and '.join(_option(p) for p in required)}"
        )
    params = {p: getattr(args, p) for p in required}
    mechanism = make_mechanism(args.noise, max_grad_norm=args.max_grad_norm, **params)
    plan = correlation_plan(parser, args)
    if plan is not None:
        sigma, accountant = args.noise_multiplier, CORRELATION_ACCOUNTANTS[plan.kind]
        epsilon = plan.epsilon(sigma, args.delta)
        summary = correlation_summary(_summary(args, mechanism, epsilon, accountant), plan)
        _emit(summary, {accountant: epsilon}, args.json, accountant)
        if args.plot:
            _plot(args, mechanism, {accountant: lambda steps: plan.epsilon(sigma, args.delta, steps)})
        return
    rc = _randomized_clipping(parser, args)
    if rc is not None:
        schedule = {"target_delta": args.delta, "sample_rate": args.sample_rate, "steps": args.steps}
        epsilon = randomized_clipping_epsilon(args.noise_multiplier, **schedule, **rc)
        _emit(_summary(args, mechanism, epsilon, "rc"), {"rc": epsilon}, args.json, "rc")
        if args.plot:

            def rc_epsilon(steps: int) -> float:
                return randomized_clipping_epsilon(args.noise_multiplier, **{**schedule, "steps": steps}, **rc)

            _plot(args, mechanism, {"rc": rc_epsilon}, points=RC_PLOT_POINTS)
        return
    cls = MECHANISMS[args.noise]
    default = cls.default_accountant  # the paper's bounds (comparison_accountants) first, the sound default last
    accountants = (args.accountant,) if args.accountant else (*cls.comparison_accountants, default)
    epsilons = _epsilons(mechanism, accountants, args)
    primary = args.accountant or default
    _emit(_summary(args, mechanism, epsilons[primary], primary), epsilons, args.json, default)
    if args.plot:
        _plot(args, mechanism, {name: _epsilon_at_steps(mechanism, name, args) for name in accountants})


def _epsilon_at_steps(mechanism: NoiseMechanism, accountant: str, args: argparse.Namespace) -> Callable[[int], float]:
    def at(steps: int) -> float:
        return mechanism_epsilon(
            mechanism,
            sample_rate=args.sample_rate,
            steps=steps,
            delta=args.delta,
            num_params=args.num_params,
            accountant=accountant,
        )

    return at


def _plot(
    args: argparse.Namespace,
    mechanism: NoiseMechanism,
    curves: dict[str, Callable[[int], float]],
    points: int = PLOT_POINTS,
) -> None:
    """Write epsilon against steps (``points`` points up to ``--steps``) for each accountant to ``--plot``."""
    from lightning_dp.utils.plots import save_epsilon_curves

    grid = sorted({max(1, round(args.steps * i / points)) for i in range(1, points + 1)})
    labelled = {
        (ACCOUNTANTS[name].plot_label or name): ([0, *grid], [0.0, *(eps(t) for t in grid)])
        for name, eps in curves.items()
    }
    params = ", ".join(f"{k}={_fmt(v)}" for k, v in mechanism.describe().items())
    title = f"{args.noise} noise ({params}), q={_fmt(args.sample_rate)}"
    path = save_epsilon_curves(args.plot, labelled, delta=args.delta, title=title)
    print(f"wrote {path}", file=sys.stderr)


def epsilon_main(argv: list[str]) -> int:
    """``lightning-dp epsilon``: epsilon after ``--steps`` steps of the given mechanism at ``--delta``."""
    parser = Parser("lightning-dp epsilon", description=epsilon_main.__doc__)
    _common_arguments(parser)
    parser.add_argument("--max-grad-norm", type=float, required=True, help="clipping bound C")
    for param, text in _noise_parameter_help().items():
        parser.add_argument(_option(param), type=float, help=text)
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help=f"also write epsilon against steps ({PLOT_POINTS} points) for each accountant shown; needs matplotlib",
    )
    return parser.run(argv, lambda args: _epsilon_body(parser, args))


def _calibrate_body(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    target = {"target_epsilon": args.target_epsilon, "target_delta": args.delta}
    schedule = {"sample_rate": args.sample_rate, "steps": args.steps}
    cls = MECHANISMS[args.noise]
    if args.search and cls.clip_search is None:
        searches = [f"--noise {name} ({c.clip_search})" for name, c in MECHANISMS.items() if c.clip_search]
        parser.error(f"--search is only defined for {' and '.join(searches)}")
    if args.search and args.num_params is None:
        parser.error(f"--search with --noise {args.noise} needs --num-params")
    plan = correlation_plan(parser, args)
    if plan is not None:
        accountant = CORRELATION_ACCOUNTANTS[plan.kind]
        mechanism = plan.calibrate(**target, max_grad_norm=args.max_grad_norm)
        epsilon = plan.epsilon(mechanism.noise_multiplier, args.delta)
        summary = _summary(args, mechanism, epsilon, accountant, target_epsilon=args.target_epsilon)
        _emit(correlation_summary(summary, plan), {accountant: epsilon}, args.json, accountant)
        return
    rc = _randomized_clipping(parser, args)
    if rc is not None:
        if args.search:
            parser.error("--search is not defined with --clipping")
        result = calibrate_randomized_clipping(**target, **schedule, **rc, max_grad_norm=args.max_grad_norm)
        summary = _summary(args, result.mechanism, result.epsilon, "rc", target_epsilon=args.target_epsilon)
        _emit(summary, {"rc": result.epsilon}, args.json, "rc")
        return
    accountant = resolve_accountant(args.noise, args.accountant)
    if args.search:
        problem = CalibrationProblem(
            **target, **schedule, max_grad_norm=args.max_grad_norm, accountant=accountant, num_params=args.num_params
        )
        result = cls.search_clipping(problem)
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
    default = cls.default_accountant
    epsilons = {accountant: epsilon}
    if default != accountant:  # e.g. laplace-advanced calibrated by "advanced": also show the sound bound
        epsilons.update(_epsilons(mechanism, (default,), args))
    summary = _summary(args, mechanism, epsilon, accountant, target_epsilon=args.target_epsilon)
    _emit(summary, epsilons, args.json, default)


def calibrate_main(argv: list[str]) -> int:
    """``lightning-dp calibrate``: noise parameters that reach ``--target-epsilon`` at ``--delta``."""
    parser = Parser("lightning-dp calibrate", description=calibrate_main.__doc__, aliases={"target_delta": "delta"})
    _common_arguments(parser)
    parser.add_argument("--target-epsilon", type=float, required=True, help="target epsilon > 0")
    parser.add_argument(
        "--max-grad-norm",
        type=float,
        default=1.0,
        help="clipping bound C (with --search: the largest C considered)",
    )
    searches = {name: cls.clip_search for name, cls in MECHANISMS.items() if cls.clip_search}
    parser.add_argument(
        "--search",
        action="store_true",
        help=f"{'/'.join(searches)}: also search the clipping bound ({' / '.join(searches.values())})",
    )
    return parser.run(argv, lambda args: _calibrate_body(parser, args))
