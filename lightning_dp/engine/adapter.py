"""The contract every trainer adapter implements, and the glue the adapters share (docs/design.md section 2.2).

The adapters are :class:`~lightning_dp.lightning.DPStrategy`, :class:`~lightning_dp.lightning.DPDDPStrategy` and
:class:`~lightning_dp.lightning.DPModelParallelStrategy` (the hooks of
:class:`~lightning_dp.lightning.dp_mixin.DPStrategyMixin`), and :class:`~lightning_dp.hf.DPTrainer`. Each drives one
:class:`~lightning_dp.engine.privacy_engine.PrivacyEngine` through the run sequence of :mod:`lightning_dp.engine.steps`
(``start_run``, ``training_loader``, ``start_training``, per micro-batch ``per_sample_loss`` and ``clip``, the noise
once per logical step in the ``DPOptimizer``, ``finish_run``, ``detach``) and exposes :class:`TrainerAdapter`.

What differs between the frameworks stays in the adapter: where each call is hooked, how a batch's size is read
(:meth:`TrainerAdapter.read_batch_size`), the wording of a refusal in the framework's own terms. What is the same
is here, once, as functions and small classes the adapters call:

- :class:`AdapterQueries`: the queries of :class:`TrainerAdapter` (``get_epsilon``, ``privacy_summary``,
  ``sample_rate``, ``num_samples``, ``last_clip_fraction``), a base class of every adapter;
- :func:`micro_batch`: the batch a training step runs on, its size, and the engine's stand-in batch for a rank whose
  Poisson micro-batch is empty on an FSDP2-sharded model;
- :data:`LOSS_SCALING_REASON`: why fp16 (its loss scaler) is refused;
- :func:`framework_clipping`: what to do with the framework's own gradient clipping (refuse it, or switch off the
  framework's default);
- :func:`rank_zero_logging` and :func:`stop_rank_zero_logging`: only rank 0 logs on several processes;
- :class:`EpsilonBudget`: the logic of the ``PrivacyBudget`` callbacks (stop before a step would exceed the budget).

This module imports neither Lightning nor transformers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from lightning_dp.accounting.base import validate_epsilon
from lightning_dp.engine.queries import PrivacyQueries

if TYPE_CHECKING:
    from lightning_dp.engine.privacy_engine import PrivacyEngine
    from lightning_dp.runtime.distributed import DistributedContext

log = logging.getLogger("lightning_dp")

#: Why every adapter refuses fp16 training (Lightning's ``precision="16-mixed"``, the Trainer's ``fp16=True``): the
#: loss scaler multiplies the loss, so the per-sample norms the clipper bounds would be those of the scaled loss.
LOSS_SCALING_REASON = "its loss scaling would corrupt the per-sample norms"


@runtime_checkable
class TrainerAdapter(Protocol):
    """What a trainer adapter provides (``isinstance(adapter, TrainerAdapter)`` checks the names).

    Attributes:
        privacy_engine: the run's engine, which holds every piece of DP state (the adapter holds none of its own
            that the guarantee depends on).
    """

    privacy_engine: PrivacyEngine

    @property
    def sample_rate(self) -> float | None:
        """The run's Poisson rate q (known once the training loader is built)."""

    @property
    def num_samples(self) -> int | None:
        """The training set's size N (known once the training loader is built)."""

    @property
    def last_clip_fraction(self) -> float | None:
        """Fraction of the last micro-batch's examples whose norm exceeded the bound (diagnostic only)."""

    def get_epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far (:meth:`~lightning_dp.engine.queries.PrivacyQueries.get_epsilon`)."""

    def privacy_summary(self) -> dict[str, Any]:
        """The run's privacy state (:meth:`~lightning_dp.engine.queries.PrivacyQueries.privacy_summary`)."""

    def read_batch_size(self, batch: Any) -> int | None:
        """The number of examples (users with ``privacy_unit="user"``) in a training micro-batch as the framework
        hands it to the step; ``None`` when it cannot be read."""


class AdapterQueries(PrivacyQueries):
    """The queries of :class:`TrainerAdapter` for an object that holds a ``privacy_engine``: a base class of
    every adapter, so they answer alike."""

    @property
    def sample_rate(self) -> float | None:
        """The run's Poisson rate q (known once the training loader is built)."""
        return self.privacy_engine.loader_sample_rate

    @property
    def num_samples(self) -> int | None:
        """The training set's size N (known once the training loader is built)."""
        return self.privacy_engine.num_samples

    @property
    def last_clip_fraction(self) -> float | None:
        """Fraction of the last micro-batch's examples whose norm exceeded ``max_grad_norm`` (diagnostic only)."""
        return self.privacy_engine.last_clip_fraction


def micro_batch(
    adapter: TrainerAdapter, batch: Any, to_device: Callable[[Any], Any] | None = None
) -> tuple[Any, int | None, bool]:
    """The micro-batch a training step runs on: ``(batch, size, stand_in)``.

    ``size`` is :meth:`TrainerAdapter.read_batch_size` of the batch. On an FSDP2-sharded model
    (:attr:`~lightning_dp.engine.steps.RunSequence.every_rank_runs_every_step`) a rank whose Poisson micro-batch is
    empty must still join the step's collectives: the batch is then the engine's
    :meth:`~lightning_dp.engine.steps.RunSequence.stand_in_batch` (moved by ``to_device`` when given), which adds
    exactly zero when run through ``per_sample_loss`` and ``clip`` with ``stand_in=True``.
    """
    engine = adapter.privacy_engine
    if adapter.read_batch_size(batch) == 0 and engine.every_rank_runs_every_step:
        batch = engine.stand_in_batch()
        if to_device is not None:
            batch = to_device(batch)
        return batch, adapter.read_batch_size(batch), True
    return batch, adapter.read_batch_size(batch), False


def framework_clipping(
    value: float | None, *, framework_default: float | None = None
) -> Literal["none", "switch off", "refuse"]:
    """What an adapter does with the framework's own gradient clipping (Lightning's ``gradient_clip_val``, the
    Trainer's ``max_grad_norm``), which would clip the batch gradient on top of the per-sample clipping.

    Returns:
        ``"none"``: not set; ``"switch off"``: the framework's default (the adapter sets it to 0 with a log line
        saying so); ``"refuse"``: any other value (the adapter raises ``ValueError`` saying what to set instead).
    """
    if not value:
        return "none"
    if framework_default is not None and value == framework_default:
        return "switch off"
    return "refuse"


def rank_zero_logging(
    distributed: DistributedContext | None, log_filter: logging.Filter | None
) -> logging.Filter | None:
    """On several processes, silence the ``lightning_dp`` logger below ERROR on ranks other than 0 (once: an
    adapter passes the filter it holds, ``None`` at first); returns the filter to hold (``None`` on rank 0 or one
    process)."""
    if distributed is not None and log_filter is None:
        return distributed.log_on_rank_zero_only()
    return log_filter


def stop_rank_zero_logging(log_filter: logging.Filter | None) -> None:
    """Remove a filter :func:`rank_zero_logging` returned (nothing for ``None``)."""
    if log_filter is not None:
        log.removeFilter(log_filter)


class EpsilonBudget:
    """The budget logic of the ``PrivacyBudget`` callbacks (Lightning's and the Trainer's): no step is taken that
    would push epsilon above the budget, and the stop is logged once.

    Args:
        target_epsilon: the budget (default: the run's ``target_epsilon``).

    Attributes:
        stopped_at_step: the engine's step count when the budget stopped training (``None`` while it has not).

    Raises:
        ValueError: a non-positive budget.
    """

    def __init__(self, target_epsilon: float | None = None) -> None:
        if target_epsilon is not None:
            validate_epsilon(target_epsilon)
        self.target_epsilon = target_epsilon
        self.stopped_at_step: int | None = None

    def start_budget(self, engine: PrivacyEngine, *, configured_in: str) -> None:
        """Set the budget on ``engine`` at the start of training (``configured_in``: where a default budget comes
        from, for the error message when there is none).

        Raises:
            ValueError: no budget given and the run has no ``target_epsilon``.
        """
        engine.set_epsilon_budget(self.target_epsilon, configured_in=configured_in)
        self.stopped_at_step = None

    def budget_spent(self, engine: PrivacyEngine) -> bool:
        """Whether the next step would exceed the budget (the adapter then stops training); logs the stop once."""
        if not engine.budget_exhausted():
            return False
        if self.stopped_at_step is None:
            self.stopped_at_step = engine.steps
            engine.log_budget_stop()
        return True
