"""The ``lightning-dp`` command: ``demo``, ``fit`` (LightningCLI), ``epsilon``, ``calibrate`` and ``audit``."""

from __future__ import annotations

import sys

USAGE = """usage: lightning-dp {demo,fit,epsilon,calibrate,audit} ...

  demo        DP-SGD on scikit-learn digits with a small CNN (offline, ~1 min on CPU)
  fit         LightningCLI: lightning-dp fit --config configs/digits_cnn.yaml
  epsilon     epsilon of a noise mechanism after T steps
  calibrate   noise parameters for a target epsilon
  audit       empirical epsilon lower bound of a training run (canaries, one run)
"""


def fit_main(argv: list[str]) -> int:
    """LightningCLI over any LightningModule/LightningDataModule given by class path in the config."""
    from lightning.pytorch import LightningDataModule, LightningModule
    from lightning.pytorch.cli import LightningCLI

    LightningCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=["fit", *argv],
        save_config_kwargs={"overwrite": True},
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``lightning-dp`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from lightning_dp.demo import main as demo_main

        return demo_main(rest)
    if command == "fit":
        return fit_main(rest)
    if command in ("epsilon", "calibrate"):
        from lightning_dp import cli_privacy

        return getattr(cli_privacy, f"{command}_main")(rest)
    if command == "audit":
        from lightning_dp.cli_audit import audit_main

        return audit_main(rest)
    print(f"unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
