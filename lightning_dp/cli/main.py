"""The ``lightning-dp`` command: ``demo``, ``tune``, ``fit`` (LightningCLI), ``epsilon``, ``calibrate`` and ``audit``.

Every subcommand runs under :func:`lightning_dp.cli.args.guarded`: bad input is one ``error:`` line on stderr with
exit code 2, never a traceback. A new subcommand is one entry in :data:`COMMANDS`.
"""

from __future__ import annotations

import importlib
import logging
import sys
import warnings
from collections.abc import Callable
from typing import NamedTuple

from lightning_dp.cli.args import USAGE_ERROR, guarded, quiet_lightning, report
from lightning_dp.utils.naming import did_you_mean

log = logging.getLogger("lightning_dp")


class Command(NamedTuple):
    """A subcommand: ``target`` is ``"module:function"``, a ``function(argv) -> exit code`` imported on use."""

    target: str
    help: str

    def load(self) -> Callable[[list[str]], int]:
        module, function = self.target.split(":")
        return getattr(importlib.import_module(module), function)


COMMANDS: dict[str, Command] = {
    "demo": Command(
        "lightning_dp.cli.demo:main", "DP-SGD on scikit-learn digits with a small CNN (offline, ~1 min on CPU)"
    ),
    "tune": Command(
        "lightning_dp.cli.tune:main", "private hyper-parameter search on digits: the best of a random number of runs"
    ),
    "fit": Command("lightning_dp.cli.main:fit_main", "LightningCLI: lightning-dp fit --config configs/digits_cnn.yaml"),
    "epsilon": Command("lightning_dp.cli.privacy:epsilon_main", "epsilon of a noise mechanism after T steps (--plot)"),
    "calibrate": Command("lightning_dp.cli.privacy:calibrate_main", "noise parameters for a target epsilon"),
    "audit": Command(
        "lightning_dp.cli.audit:audit_main", "empirical epsilon lower bound of a training run (canaries, one run)"
    ),
}


def usage() -> str:
    """The top-level help: one line per subcommand."""
    lines = [f"usage: lightning-dp {{{','.join(COMMANDS)}}} ...", ""]
    lines += [f"  {name:<10}  {command.help}" for name, command in COMMANDS.items()]
    lines += ["", "lightning-dp COMMAND --help describes each command's options."]
    return "\n".join(lines)


def fit_main(argv: list[str]) -> int:
    """LightningCLI over any LightningModule/LightningDataModule given by class path in the config; logs the
    calibration line and, at the end, the privacy summary (also when the config has no PrivacyAccountantCallback).
    """
    from jsonargparse import ArgumentError
    from lightning.pytorch import LightningDataModule, LightningModule

    from lightning_dp.cli.fit import FitCLI
    from lightning_dp.lightning.callbacks import PrivacyAccountantCallback, format_summary

    quiet_lightning()
    with warnings.catch_warnings():
        # LightningCLI warns whenever args= is passed while sys.argv has arguments, which is always the case here
        # (they are the same arguments); only that message is ignored, and only here.
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
        try:
            cli = FitCLI(
                LightningModule,
                LightningDataModule,
                subclass_mode_model=True,
                subclass_mode_data=True,
                args=["fit", *argv],
                parser_kwargs={"exit_on_error": False},
            )
        except ArgumentError as err:  # a config error that names no option (those are ConfigError): one line
            raise ValueError(f"{err} (see lightning-dp fit --help)") from err
    trainer = cli.trainer
    engine = getattr(trainer.strategy, "privacy_engine", None)
    reported = any(isinstance(cb, PrivacyAccountantCallback) for cb in trainer.callbacks)
    if engine is not None and engine.accountant is not None and not reported and trainer.is_global_zero:
        log.info("Privacy summary: %s", format_summary(engine.summary()))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lightning-dp`` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else USAGE_ERROR
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        return report(
            "lightning-dp", f"unknown command {name!r}{did_you_mean(name, COMMANDS)}; choose from {', '.join(COMMANDS)}"
        )
    command = COMMANDS[name].load()
    return guarded(f"lightning-dp {name}", lambda: command(rest))


if __name__ == "__main__":
    raise SystemExit(main())
