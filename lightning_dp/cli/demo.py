"""``lightning-dp demo``: DP-SGD on scikit-learn's digits with a small CNN, end to end, offline.

Lightning and the digits task are imported by :func:`train_digits`, and the options' choices are the built-in names
(:mod:`lightning_dp.cli.builtin_names`), so ``lightning-dp demo --help`` and a bad option answer without loading
torch, Lightning or the accountants.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Sequence
from typing import Any

from lightning_dp.cli.args import Parser, choice, metavar_of, positive_float, positive_int, quiet_lightning
from lightning_dp.cli.builtin_names import ACCOUNTANTS, AUTO, CLIPPING, NOISES


@dataclasses.dataclass(frozen=True)
class DigitsRun:
    """One trained ``DigitsCNN``: the trainer, model and data after ``fit``, the privacy summary, the epoch table's rows
    and the seconds ``fit`` took."""

    trainer: Any
    model: Any
    data: Any
    privacy: dict[str, Any]
    epochs: list[dict[str, float]]
    seconds: float


def train_digits(
    *,
    epochs: int,
    batch_size: int,
    max_grad_norm: float,
    lr: float,
    momentum: float = 0.5,
    seed: int | None = 0,
    progress_bar: bool = True,
    callbacks: Sequence[Any] = (),
    **strategy_options: Any,
) -> DigitsRun:
    """Train ``DigitsCNN`` with :class:`~lightning_dp.DPStrategy` on the CPU (what ``demo`` and ``tune`` run).

    Args:
        seed: seed of the model's initialisation and of the run's noise and sampling; ``None``: OS entropy (as
            ``secure_mode`` requires).
        progress_bar: print the epoch table, and in a terminal Lightning's progress bar (none when the standard
            output is a file or a pipe: the table's rows are then the progress lines).
        callbacks: further Lightning callbacks of the trainer.
        strategy_options: the privacy options of :class:`~lightning_dp.DPStrategy` (``target_epsilon`` or
            ``noise_multiplier``, ``target_delta``, ``noise``, ...).

    Raises:
        ValueError: an invalid privacy option (as :class:`~lightning_dp.DPStrategy`).
    """
    import lightning.pytorch as pl

    from lightning_dp.lightning import DPStrategy, PrivacyAccountantCallback
    from lightning_dp.lightning.callbacks import EpochTable
    from lightning_dp.lightning.progress_bar import terminal_progress_bar
    from lightning_dp.runtime.randomness import os_seed
    from lightning_dp.tasks.digits import DigitsCNN, DigitsDataModule

    # the model's initialisation from the seed, or from fresh OS entropy (never the state an earlier run left)
    pl.seed_everything(seed if seed is not None else os_seed() >> 32, verbose=False)
    data = DigitsDataModule(batch_size=batch_size)
    model = DigitsCNN(lr=lr, momentum=momentum)
    privacy_callback = PrivacyAccountantCallback()
    table = EpochTable("val_acc", enabled=progress_bar)
    bar = terminal_progress_bar() if progress_bar else None
    strategy = DPStrategy(max_grad_norm=max_grad_norm, seed=seed, device="cpu", **strategy_options)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_epochs=epochs,
        callbacks=[privacy_callback, table, *([bar] if bar else []), *callbacks],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=bar is not None,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    start = time.perf_counter()
    trainer.fit(model, datamodule=data)
    seconds = time.perf_counter() - start
    return DigitsRun(trainer, model, data, privacy_callback.summary or {}, table.rows, seconds)


def run_demo(
    *,
    target_epsilon: float = 3.0,
    target_delta: float = 1e-5,
    epochs: int = 15,
    batch_size: int = 128,
    max_grad_norm: float = 1.0,
    lr: float = 1.0,
    clipping: str = AUTO,
    noise: str = "gaussian",
    accountant: str | None = None,
    seed: int = 0,
    progress_bar: bool = True,
    callbacks: Sequence[Any] = (),
    **strategy_options: Any,
) -> dict[str, Any]:
    """Train ``DigitsCNN`` with DP (:func:`train_digits`), test it, and return the final metrics and privacy summary.

    Args:
        progress_bar: print the epoch table, and in a terminal Lightning's progress bar (none when the standard
            output is a file or a pipe: the table's rows are then the progress lines).
        callbacks: further Lightning callbacks of the trainer.
        strategy_options: further :class:`~lightning_dp.DPStrategy` options (e.g. ``target_unclipped_quantile``).

    Returns:
        ``{"test_acc", "epsilon", "delta", "seconds", "epochs": [per-epoch rows], "privacy": summary}``.

    Raises:
        ValueError: an invalid privacy option (as :class:`~lightning_dp.DPStrategy`).
    """
    start = time.perf_counter()
    run = train_digits(
        epochs=epochs,
        batch_size=batch_size,
        max_grad_norm=max_grad_norm,
        lr=lr,
        seed=seed,
        progress_bar=progress_bar,
        callbacks=callbacks,
        target_epsilon=target_epsilon,
        target_delta=target_delta,
        clipping=clipping,
        noise=noise,
        accountant=accountant,
        **strategy_options,
    )
    (test,) = run.trainer.test(run.model, datamodule=run.data, verbose=False)
    return {
        "test_acc": test["test_acc"],
        "epsilon": run.privacy.get("epsilon"),
        "delta": run.privacy.get("delta"),
        "seconds": time.perf_counter() - start,
        "epochs": run.epochs,
        "privacy": run.privacy,
    }


def main(argv: list[str]) -> int:
    """Parse ``lightning-dp demo`` arguments, run, print the result (exit code 2 with one line on bad input)."""
    parser = Parser(
        "lightning-dp demo", description="DP-SGD on scikit-learn's digits with a small CNN, end to end, offline."
    )
    parser.add_argument("--target-epsilon", type=positive_float, default=3.0, help="privacy budget epsilon (> 0)")
    parser.add_argument("--target-delta", type=float, default=1e-5, help="delta in (0, 1), below 1/N")
    parser.add_argument("--epochs", type=positive_int, default=15, help="training epochs (>= 1)")
    parser.add_argument("--batch-size", type=positive_int, default=128, help="expected Poisson batch size")
    parser.add_argument("--max-grad-norm", type=positive_float, default=1.0, help="per-sample clipping bound C")
    parser.add_argument("--lr", type=positive_float, default=1.0, help="SGD learning rate")
    parser.add_argument(
        "--clipping",
        type=choice(CLIPPING),
        metavar=metavar_of(CLIPPING),
        default=AUTO,
        help="per-sample clipping engine (auto: mixed for l2 noise, flat for laplace)",
    )
    parser.add_argument(
        "--noise", type=choice(NOISES), metavar=metavar_of(NOISES), default="gaussian", help="noise mechanism"
    )
    parser.add_argument(
        "--accountant",
        type=choice(ACCOUNTANTS),
        metavar=metavar_of(ACCOUNTANTS),
        default=None,
        help="privacy accountant (default: the mechanism's sound accountant, pld for gaussian)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, data split and noise generators")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return parser.run(argv, _run)


def _run(args: argparse.Namespace) -> None:
    quiet_lightning()
    result = run_demo(
        target_epsilon=args.target_epsilon,
        target_delta=args.target_delta,
        epochs=args.epochs,
        batch_size=args.batch_size,
        max_grad_norm=args.max_grad_norm,
        lr=args.lr,
        clipping=args.clipping,
        noise=args.noise,
        accountant=args.accountant,
        seed=args.seed,
        progress_bar=not args.json,
    )
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"test accuracy {result['test_acc']:.4f} at epsilon {result['epsilon']:.4f}, delta {result['delta']:.0e}"
        f" ({result['privacy'].get('noise')}, {result['privacy'].get('clipping')} clipping, {result['seconds']:.1f} s)"
    )
