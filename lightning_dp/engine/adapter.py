"""The contract every trainer adapter implements, and the glue the adapters share (docs/design.md section 2.2).

The adapters (:mod:`lightning_dp.lightning`, :class:`~lightning_dp.hf.DPTrainer`) drive one
:class:`~lightning_dp.engine.privacy_engine.PrivacyEngine` through :mod:`lightning_dp.engine.steps` and expose
:class:`TrainerAdapter`; what is framework-independent lives here. Imports neither Lightning nor transformers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from lightning_dp.accounting.base import validate_epsilon

if TYPE_CHECKING:
    from lightning_dp.engine.privacy_engine import PrivacyEngine
    from lightning_dp.runtime.distributed import DistributedContext

log = logging.getLogger("lightning_dp")

#: Why Lightning's ``precision="16-true"`` (and the transformer-engine precisions) are refused: float16 parameters
#: without a loss scaler. float16 autocast with float32 parameters (``"16-mixed"``, the Trainer's ``fp16=True``) is
#: supported: :mod:`lightning_dp.engine.grad_scaler`.
LOSS_SCALING_REASON = "float16 or float8 parameters; float16 autocast over float32 ones is supported as '16-mixed'"


@runtime_checkable
class TrainerAdapter(Protocol):
    """What a trainer adapter provides (``isinstance(adapter, TrainerAdapter)`` checks the names).

    Attributes:
        privacy_engine: the run's engine, which holds all DP state.
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
        """Fraction of the last clipped pass's examples whose norm exceeded the bound (diagnostic only)."""

    def get_epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far (:meth:`~lightning_dp.engine.queries.PrivacyQueries.get_epsilon`)."""

    def privacy_summary(self) -> dict[str, Any]:
        """The run's privacy state (:meth:`~lightning_dp.engine.queries.PrivacyQueries.privacy_summary`)."""

    def read_batch_size(self, batch: Any) -> int | None:
        """The number of examples (users with ``privacy_unit="user"``) in a training micro-batch as the framework
        hands it to the step; ``None`` when it cannot be read."""


def micro_batch(
    adapter: TrainerAdapter, batch: Any, to_device: Callable[[Any], Any] | None = None
) -> tuple[Any, int | None, bool]:
    """The micro-batch a training step runs on: ``(batch, size, stand_in)``; on an FSDP2-sharded model an empty
    micro-batch is replaced by the engine's :meth:`~lightning_dp.engine.steps.RunSequence.stand_in_batch` (moved by
    ``to_device``).
    """
    engine = adapter.privacy_engine
    size = adapter.read_batch_size(batch)
    if size == 0 and engine.every_rank_runs_every_step:
        batch = engine.stand_in_batch()
        if to_device is not None:
            batch = to_device(batch)
        return batch, adapter.read_batch_size(batch), True
    return batch, size, False


def framework_clipping(
    value: float | None, *, framework_default: float | None = None
) -> Literal["none", "switch off", "refuse"]:
    """What an adapter does with the framework's own gradient clipping (``gradient_clip_val``, ``max_grad_norm``).

    Returns:
        ``"none"``: not set; ``"switch off"``: the framework's default (set to 0, logged); ``"refuse"``: any other
        value.
    """
    if not value:
        return "none"
    if framework_default is not None and value == framework_default:
        return "switch off"
    return "refuse"


def rank_zero_logging(
    distributed: DistributedContext | None, log_filter: logging.Filter | None
) -> logging.Filter | None:
    """On several processes, silence the ``lightning_dp`` logger below ERROR on ranks other than 0; returns the filter
    to hold (``None`` on rank 0 or one process).
    """
    if distributed is not None and log_filter is None:
        return distributed.log_on_rank_zero_only()
    return log_filter


def stop_rank_zero_logging(log_filter: logging.Filter | None) -> None:
    """Remove a filter :func:`rank_zero_logging` returned (nothing for ``None``)."""
    if log_filter is not None:
        log.removeFilter(log_filter)


class EpsilonBudget:
    """The budget logic of the ``PrivacyBudget`` callbacks: no step is taken that would push epsilon above the budget.

    Args:
        target_epsilon: the budget (default: the run's ``target_epsilon``).

    Attributes:
        stopped_at_step: the step count when the budget stopped training (``None`` until then).

    Raises:
        ValueError: a non-positive budget.
    """

    def __init__(self, target_epsilon: float | None = None) -> None:
        if target_epsilon is not None:
            validate_epsilon(target_epsilon)
        self.target_epsilon = target_epsilon
        self.stopped_at_step: int | None = None

    def start_budget(self, engine: PrivacyEngine, *, configured_in: str) -> None:
        """Set the budget on ``engine`` (``configured_in`` names where a default budget comes from, for the error
        message).

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
