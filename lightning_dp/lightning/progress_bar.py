"""Lightning's progress bar where it belongs: in a terminal, showing epsilon to four decimals as the epoch table does
(Lightning's bars round every metric to three digits: 2.9982 showed as ``3.000``); in a log file, none (a bar redraws
its line with carriage returns, which a file keeps, hundreds of fragments around the epoch table).
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any, TextIO

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from typing_extensions import override

#: The metric the bar shows to four decimals (logged by :class:`~lightning_dp.PrivacyAccountantCallback`).
EPSILON = "epsilon"


class _EpsilonDecimals(ProgressBar):
    """The progress-bar metrics, epsilon as text with four decimals (Lightning's way to change what a bar shows)."""

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        if isinstance(metrics.get(EPSILON), float):
            metrics[EPSILON] = f"{metrics[EPSILON]:.4f}"
        return metrics


class EpsilonRichProgressBar(_EpsilonDecimals, RichProgressBar):
    """Lightning's ``RichProgressBar``, epsilon shown to four decimals."""


class EpsilonTQDMProgressBar(_EpsilonDecimals, TQDMProgressBar):
    """Lightning's ``TQDMProgressBar``, epsilon shown to four decimals."""


def epsilon_progress_bar_class() -> type[ProgressBar]:
    """The bar Lightning would pick (Rich where it is installed, else TQDM), epsilon shown to four decimals."""
    return EpsilonRichProgressBar if importlib.util.find_spec("rich") else EpsilonTQDMProgressBar


def is_terminal(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default: the standard output) is a terminal, where a progress bar can redraw its line."""
    stream = sys.stdout if stream is None else stream
    return hasattr(stream, "isatty") and stream.isatty()


def terminal_progress_bar(stream: TextIO | None = None) -> ProgressBar | None:
    """The bar of :func:`epsilon_progress_bar_class` when ``stream`` (default: the standard output) is a terminal, else
    ``None``: pass it in ``Trainer(callbacks=...)`` with ``enable_progress_bar=bar is not None``, and let an epoch
    table or :class:`~lightning_dp.TrainingProgress` give the lines in a log file."""
    return epsilon_progress_bar_class()() if is_terminal(stream) else None
