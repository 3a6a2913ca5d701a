"""One progress line every ``log_every_n_steps`` optimizer steps: a progress report that stays readable in a log
file (a progress bar redraws its line with carriage returns)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_dp.runtime.console import show_info_lines

log = logging.getLogger("lightning_dp")


class TrainingProgress(Callback):
    """Logs ``step 10/40: loss 2.1034, epsilon 1.52 (31 s)`` on the ``lightning_dp`` logger (INFO, rank 0 only on
    several processes; shown on stderr in a script without logging set-up, see :mod:`lightning_dp.runtime.console`)
    every ``Trainer(log_every_n_steps=...)`` optimizer steps and at the last one.

    ``loss`` is the mean of the training step's (mean) losses over the micro-batches since the previous line, on
    this process; ``epsilon`` is spent so far at the strategy's ``target_delta`` (left out without a DP strategy);
    the time is counted from the start of training. The loss is not privatised: keep it out of published logs.

    Attributes:
        lines: the lines logged so far.
    """

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._losses: list[float] = []
        self._last_step = 0
        self._start = 0.0
        self._planned = math.inf

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._losses, self._last_step, self._start = [], trainer.global_step, time.perf_counter()
        self._planned = trainer.estimated_stepping_batches
        show_info_lines(log)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if loss is not None:
            self._losses.append(float(loss))
        step = trainer.global_step
        due = step % max(trainer.log_every_n_steps, 1) == 0 or step >= self._planned
        if step == self._last_step or not due:
            return
        self._last_step = step
        parts = [f"loss {sum(self._losses) / len(self._losses):.4f}"] if self._losses else []
        engine = getattr(trainer.strategy, "privacy_engine", None)
        if engine is not None:
            parts.append(f"epsilon {engine.epsilon():.4g}")
        planned = f"/{int(self._planned)}" if math.isfinite(self._planned) else ""
        line = f"step {step}{planned}: {', '.join(parts)} ({time.perf_counter() - self._start:.0f} s)"
        self._losses = []
        self.lines.append(line)
        log.info(line)
