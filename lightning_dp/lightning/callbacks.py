"""Callbacks reporting and enforcing the privacy budget of a ``DPStrategy`` run."""

from __future__ import annotations

import logging
import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_dp.engine.accounting import summary_metrics
from lightning_dp.engine.adapter import EpsilonBudget
from lightning_dp.engine.privacy_engine import PrivacyEngine
from lightning_dp.utils.plots import MISSING_MATPLOTLIB, epsilon_curve_figure, log_figure, matplotlib_available

log = logging.getLogger("lightning_dp")


def privacy_engine_of(trainer: pl.Trainer) -> PrivacyEngine:
    """The ``PrivacyEngine`` of the trainer's strategy. Raises ``TypeError`` if the strategy is not DP."""
    engine = getattr(trainer.strategy, "privacy_engine", None)
    if not isinstance(engine, PrivacyEngine):
        raise TypeError("This callback needs Trainer(strategy=DPStrategy(...))")
    return engine


#: Summary entries that change as training goes on: metrics only, never tracker parameters (MLflow refuses to change a
#: logged parameter, e.g. when a second fit or a resume logs into the same run).
PROGRESS_KEYS = ("epsilon", "steps")


def tracker_params(summary: dict[str, Any]) -> dict[str, Any]:
    """The run's fixed privacy settings as experiment-tracker parameters (keys ``dp/<name>``: noise and its
    parameters, delta, sample rate, accountant, clipping...; not :data:`PROGRESS_KEYS`, nor under adaptive clipping
    the moving ``max_grad_norm``): numbers and strings as they are, anything else (e.g. the low-pass filter's
    description) as its ``str``."""
    moving = (*PROGRESS_KEYS, "max_grad_norm") if "initial_max_grad_norm" in summary else PROGRESS_KEYS  # adaptive
    return {f"dp/{k}": v if isinstance(v, (int, float, str)) else str(v) for k, v in summary.items() if k not in moving}


def format_summary(summary: dict[str, Any]) -> str:
    """``"epsilon=2.98, delta=1e-05, noise=gaussian, ..."``: the one-line form of ``PrivacyEngine.summary()``."""
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items())


class PrivacyAccountantCallback(Callback):
    """Logs ``epsilon`` after every training epoch (to all loggers and the progress bar), a final summary, and a
    privacy-curve image (epsilon against steps) to the loggers that take images; with adaptive clipping, also the
    clipping bound ``dp/max_grad_norm`` after every step (as Lightning logs step metrics, every ``log_every_n_steps``).

    Args:
        delta: delta to report epsilon at (default: the strategy's ``target_delta``).
        plot: log the privacy curve as an image at the end of training (``TensorBoardLogger`` via
            ``add_figure``, ``MLFlowLogger`` as an artifact, any logger with ``log_image``). ``None`` (default):
            when matplotlib is installed; ``True``: required (``ImportError`` naming the ``plot`` extra at the
            start of fit if missing).

    Attributes:
        history: ``[(epoch, steps, epsilon)]`` for every epoch.
        summary: the final report (epsilon, delta, noise parameters, steps, sample rate, accountant), set at the
            end of training; also sent to every logger, its numbers as metrics and its fixed settings (all but
            epsilon and the step count) as hyperparameters (``dp/<name>``).
    """

    #: tag of the privacy-curve image in the loggers.
    plot_tag = "privacy/epsilon_curve"

    def __init__(self, delta: float | None = None, plot: bool | None = None) -> None:
        self.delta = delta
        self.plot = plot
        self.history: list[tuple[int, int, float]] = []
        self.summary: dict[str, Any] | None = None

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.plot and not matplotlib_available():
            raise ImportError(f"PrivacyAccountantCallback(plot=True): {MISSING_MATPLOTLIB}")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # The progress bar shows step metrics logged in an earlier batch hook, but epoch metrics only after every
        # on_train_epoch_end hook has run: an epsilon logged in on_train_epoch_end alone reached the bar one epoch
        # late. So the bar's value is logged here, as a step metric, on each epoch's last batch (and every
        # log_every_n_steps steps); the epoch hook logs the same value to the loggers.
        engine = privacy_engine_of(trainer)
        if engine.adaptive is not None and trainer.loggers:  # the bound the next step clips at (a released value)
            pl_module.log("dp/max_grad_norm", engine.current_max_grad_norm, logger=True, on_step=True, on_epoch=False)
        every = trainer.log_every_n_steps
        if (
            trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
            or trainer.should_stop
            or (every and trainer.global_step % every == 0)
        ):
            epsilon = engine.epsilon(self.delta)
            pl_module.log("epsilon", epsilon, prog_bar=True, logger=False, on_step=True, on_epoch=False)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = privacy_engine_of(trainer)
        epsilon = engine.epsilon(self.delta)
        self.history.append((trainer.current_epoch, engine.steps, epsilon))
        if trainer.loggers:
            # identical on every rank (same ledger); sync_dist only states so to Lightning on several processes
            pl_module.log("epsilon", epsilon, logger=True, on_step=False, on_epoch=True, sync_dist=True)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        engine = privacy_engine_of(trainer)
        if engine.accountant is None:
            return
        self.summary = engine.summary()
        if self.delta is not None:
            self.summary.update(epsilon=engine.epsilon(self.delta), delta=self.delta)
        numeric = {f"dp/{k}": v for k, v in summary_metrics(self.summary).items()}
        for logger in trainer.loggers:
            logger.log_metrics(numeric, step=trainer.global_step)
            logger.log_hyperparams(tracker_params(self.summary))
        if trainer.is_global_zero:
            log.info("Privacy summary: %s", format_summary(self.summary))
            if not math.isfinite(self.summary["epsilon"]):
                log.warning(
                    "epsilon is infinite: this run has NO differential-privacy guarantee (no noise, or noise the "
                    "accountant cannot bound)"
                )
            self._log_curve(trainer)

    def _log_curve(self, trainer: pl.Trainer) -> None:
        """The epsilon-against-steps figure of :attr:`history` to every logger that takes images."""
        if self.plot is False or not trainer.loggers or not self.history or not matplotlib_available():
            return
        assert self.summary is not None
        steps = [0] + [row[1] for row in self.history]
        epsilons = [0.0] + [row[2] for row in self.history]
        label = f"{self.summary['noise']} noise, {self.summary['accountant']} accountant"
        figure = epsilon_curve_figure({label: (steps, epsilons)}, delta=self.summary["delta"], title=label)
        for logger in trainer.loggers:
            log_figure(logger, self.plot_tag, figure, trainer.global_step)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"history": self.history}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [tuple(row) for row in state_dict["history"]]


class PrivacyBudget(EpsilonBudget, Callback):
    """Stops training before a step would push epsilon above the budget, with a message saying so (the logic of
    :class:`~lightning_dp.engine.adapter.EpsilonBudget`, shared with :class:`lightning_dp.hf.PrivacyBudget`).

    Args:
        target_epsilon: the budget (default: the strategy's ``target_epsilon``).

    Raises:
        ValueError: non-positive budget, or none given and the strategy has no ``target_epsilon``.
    """

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_budget(privacy_engine_of(trainer), configured_in="DPStrategy")

    def _stop_if_exhausted(self, trainer: pl.Trainer) -> None:
        if self.budget_spent(privacy_engine_of(trainer)):
            trainer.should_stop = True

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Checked after each completed batch, so Lightning's step counter never advances for a skipped step.
        self._stop_if_exhausted(trainer)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A resumed run may start with the budget already spent.
        self._stop_if_exhausted(trainer)


class EpochTable(Callback):
    """Prints one aligned row per epoch (epoch, mean train loss, validation metric, epsilon) above the
    progress bar, through Lightning's progress bar ``print`` so the bar is not broken.

    Args:
        val_metric: name of a metric the module logs during validation (e.g. ``"val_acc"``).
        enabled: print the rows (``False`` only collects them in ``rows``).

    Attributes:
        rows: the rows as dicts.
    """

    def __init__(self, val_metric: str = "val_acc", enabled: bool = True) -> None:
        self.val_metric = val_metric
        self.enabled = enabled
        self.rows: list[dict[str, float]] = []
        self._losses: list[float] = []

    def _print(self, trainer: pl.Trainer, text: str) -> None:
        if not self.enabled:
            return
        bar = trainer.progress_bar_callback
        if bar is not None and hasattr(bar, "print"):
            bar.print(text)
        else:
            print(text)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._losses = []

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if loss is not None and loss.numel():
            self._losses.append(float(loss))

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        train_loss = sum(self._losses) / max(len(self._losses), 1)
        val = trainer.callback_metrics.get(self.val_metric)
        row = {
            "epoch": trainer.current_epoch,
            "train_loss": train_loss,
            self.val_metric: float(val) if val is not None else float("nan"),
            "epsilon": privacy_engine_of(trainer).epsilon(),
        }
        self.rows.append(row)
        if len(self.rows) == 1:
            self._print(trainer, f"{'epoch':>5}  {'train_loss':>10}  {self.val_metric:>10}  {'epsilon':>8}")
        self._print(
            trainer,
            f"{row['epoch']:>5}  {train_loss:>10.4f}  {row[self.val_metric]:>10.4f}  {row['epsilon']:>8.4f}",
        )
