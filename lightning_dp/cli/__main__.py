"""``python -m lightning_dp.cli``: the ``lightning-dp`` command."""

from lightning_dp.cli.main import main

raise SystemExit(main())
