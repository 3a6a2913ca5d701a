"""The ``lightning-dp`` command line: every subcommand, one module each.

- ``main``: the ``lightning-dp`` entry point and its table of subcommands (``python -m lightning_dp.cli``).
- ``args``: what every subcommand shares: its argument parser, typed options and one error handler.
- ``demo``: ``lightning-dp demo``, DP-SGD on scikit-learn's digits.
- ``fit``: the LightningCLI of ``lightning-dp fit``, with ``jsonargparse_errors`` reading its errors back.
- ``privacy``: ``lightning-dp epsilon`` and ``lightning-dp calibrate``.
- ``audit``: ``lightning-dp audit``, an empirical epsilon lower bound of a training run.

Nothing is imported here: ``lightning-dp --help`` loads only what it shows.
"""
