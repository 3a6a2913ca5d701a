"""``lightning-dp tune``: a private hyper-parameter search on the digits task (the demo's training,
:func:`~lightning_dp.cli.demo.train_digits`), with one epsilon for the whole search (docs/tuning.md).

Each candidate is one DP-SGD run of ``DigitsCNN`` with hyper-parameters drawn uniformly from the lists given; its score
is the accuracy on the digits' validation split, which the command declares public. Only the winner is printed and
kept in ``--output-dir``. Lightning and the tuning package are imported after the arguments are parsed, so ``--help``
and a bad option answer without loading torch.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning_dp.cli.args import Parser, positive_float, positive_int, quiet_lightning

if TYPE_CHECKING:
    from lightning_dp.tuning import Candidate

#: The hyper-parameters ``tune`` searches over: flag name -> ``DigitsCNN`` / ``DPStrategy`` argument.
SEARCHED = {"lr": "lr", "max_grad_norm": "max_grad_norm", "momentum": "momentum"}


def values_of(check: Callable[[str], float]) -> Callable[[str], tuple[float, ...]]:
    """An argparse ``type``: comma-separated values, each read by ``check`` (``"0.1,0.5,1"``)."""

    def parse(text: str) -> tuple[float, ...]:
        values = tuple(check(value) for value in text.split(",") if value.strip())
        if not values:
            raise argparse.ArgumentTypeError(f"must list at least one value, got {text!r}")
        return values

    parse.__name__ = "list"
    return parse


def momentum_value(text: str) -> float:
    """An argparse ``type``: an SGD momentum in ``[0, 1)``."""
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1), got {text}")
    return value


def shape_value(text: str) -> float:
    """An argparse ``type``: the shape of the law of ``K`` (a number, or ``inf`` for Poisson)."""
    return float(text)


def main(argv: list[str]) -> int:
    """Parse ``lightning-dp tune`` arguments, run the search, print the winner (exit code 2 with one line on bad
    input)."""
    parser = Parser(
        "lightning-dp tune",
        description="A private hyper-parameter search on scikit-learn's digits: a random number of DP-SGD runs with "
        "hyper-parameters drawn from the lists given, the best released, one epsilon for the whole search.",
    )
    lists = {"metavar": "V1,V2,..."}
    parser.add_argument("--lr", type=values_of(positive_float), default="0.5,1,2", help="SGD learning rates", **lists)
    parser.add_argument(
        "--max-grad-norm", type=values_of(positive_float), default="1", help="per-sample clipping bounds C", **lists
    )
    parser.add_argument(
        "--momentum", type=values_of(momentum_value), default="0.5", help="SGD momenta in [0, 1)", **lists
    )
    parser.add_argument("--mean-repetitions", type=float, default=3.0, help="expected number of candidates E[K] (> 1)")
    parser.add_argument(
        "--shape",
        type=shape_value,
        default=1.0,
        help="law of K: 1 geometric, 0 logarithmic, other positive values truncated negative binomial, inf Poisson",
    )
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument(
        "--target-epsilon", type=positive_float, help="epsilon of the whole search (3 unless --noise-multiplier)"
    )
    budget.add_argument("--noise-multiplier", type=positive_float, help="every candidate's noise multiplier sigma")
    parser.add_argument("--target-delta", type=float, default=1e-5, help="delta in (0, 1), below 1/N")
    parser.add_argument("--epochs", type=positive_int, default=15, help="training epochs of each candidate (>= 1)")
    parser.add_argument("--batch-size", type=positive_int, default=128, help="expected Poisson batch size")
    parser.add_argument(
        "--seed", type=int, help="seed of K, the draws and the candidates' runs (experiments only; default OS entropy)"
    )
    parser.add_argument(
        "--secure-mode", action="store_true", help="K, the draws and the noise from fresh OS entropy (no --seed)"
    )
    parser.add_argument(
        "--output-dir",
        default="lightning-dp-tune",
        help="the search's folder: its state (resume by running the same command again), the winner, result.json",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser.run(argv, _run)


def digits_schedule(batch_size: int, epochs: int) -> tuple[float, int]:
    """``(q, T)`` of one digits run: the Poisson rate ``batch_size / N`` over the training split and ``epochs``
    epochs of ``ceil(1/q)`` steps each (as :class:`~lightning_dp.DPStrategy` plans them)."""
    from lightning_dp.tasks.digits import DigitsDataModule

    data = DigitsDataModule(batch_size=batch_size)
    data.setup()
    sample_rate = batch_size / len(data.train_set)
    return sample_rate, epochs * math.ceil(1 / sample_rate)


def digits_candidate(
    *, epochs: int, batch_size: int, target_delta: float
) -> Callable[[Candidate], tuple[float, dict[str, Any]]]:
    """``train_candidate`` of a search on digits: one :func:`~lightning_dp.cli.demo.train_digits` run with the
    candidate's ``lr``, ``max_grad_norm``, ``momentum``, seed and secure mode and the plan's noise, scored by the
    accuracy on the validation split (declared public); the artifact is the model's state dict.

    Raises:
        PlanMismatchError: the run spent another event than the candidate's (:meth:`Candidate.check_spent
            <lightning_dp.tuning.search.Candidate.check_spent>`; a bug: the search's epsilon would not hold); the
            search stops.
    """
    from lightning_dp.cli.demo import train_digits

    def train_candidate(candidate: Candidate) -> tuple[float, dict[str, Any]]:
        hparams = candidate.hparams
        run = train_digits(
            epochs=epochs,
            batch_size=batch_size,
            max_grad_norm=hparams["max_grad_norm"],
            lr=hparams["lr"],
            momentum=hparams["momentum"],
            seed=candidate.seed,
            progress_bar=False,
            noise_multiplier=candidate.noise_multiplier,
            sample_rate=candidate.sample_rate,
            target_delta=target_delta,
            secure_mode=candidate.secure_mode,
        )
        candidate.check_spent(run.trainer.strategy.privacy_engine)
        (validation,) = run.trainer.validate(run.model, datamodule=run.data, verbose=False)
        return validation["val_acc"], {name: value.detach().cpu() for name, value in run.model.state_dict().items()}

    return train_candidate


def _run(args: argparse.Namespace) -> None:
    from lightning_dp.tuning import RepetitionDistribution, SearchPlan, private_search

    quiet_lightning()
    repetitions = RepetitionDistribution(args.mean_repetitions, args.shape)
    sample_rate, steps = digits_schedule(args.batch_size, args.epochs)
    schedule = {"sample_rate": sample_rate, "steps": steps, "target_delta": args.target_delta}
    if args.noise_multiplier is not None:
        plan = SearchPlan(args.noise_multiplier, repetitions=repetitions, **schedule)
    else:
        target = 3.0 if args.target_epsilon is None else args.target_epsilon
        plan = SearchPlan.for_target_epsilon(target, repetitions=repetitions, **schedule)
    train_candidate = digits_candidate(epochs=args.epochs, batch_size=args.batch_size, target_delta=plan.target_delta)

    result = private_search(  # quiet: nothing printed per candidate (docs/tuning.md)
        train_candidate,
        {name: list(getattr(args, name)) for name in SEARCHED},
        plan,
        args.output_dir,
        seed=args.seed,
        secure_mode=args.secure_mode,
        quiet=True,
    )
    report = {
        "hparams": result.hparams,
        "val_acc": result.score,
        "epsilon": result.epsilon,
        "delta": result.delta,
        "candidate_epsilon": result.candidate_epsilon,
        "noise_multiplier": plan.noise_multiplier,
        "mean_repetitions": repetitions.mean,
        "shape": repetitions.shape,
        "output_dir": str(result.output_dir),
        "failure": result.failure,
    }
    if args.json:
        print(json.dumps(report))
        return
    if result.failure is not None:
        settings = ", ".join(f"{name} {value:g}" for name, value in result.hparams.items())
        print(f"winner: {settings}: its training failed ({result.failure}); every candidate failed or scored NaN")
    elif result.released:
        settings = ", ".join(f"{name} {value:g}" for name, value in result.hparams.items())
        print(f"winner: {settings}: validation accuracy {result.score:.4f} (the held-out split, declared public)")
    else:
        print("no candidate was drawn (K = 0 under the Poisson law): nothing is released")
    print(
        f"the whole search: epsilon {result.epsilon:.4f} at delta {result.delta:.0e} ({repetitions.name} number of "
        f"candidates, mean {repetitions.mean:g}); one candidate alone: epsilon {result.candidate_epsilon:.4f} "
        f"(noise multiplier {plan.noise_multiplier:.4g}, {plan.steps} steps)"
    )
    if result.released and result.failure is None:
        print(f"the winner's weights: {result.output_dir / 'winner.saved.pt'}; the released result: result.json beside")
