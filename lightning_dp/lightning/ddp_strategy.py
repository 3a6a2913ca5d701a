"""DPDDPStrategy: DP-SGD on several processes (devices or nodes) with Lightning's DDP launcher and process group.

The guarantee is that of one process at the global sample rate (docs/design.md section 8). The module is NOT
wrapped in ``DistributedDataParallel``: :meth:`DPDDPStrategy.configure_ddp` broadcasts rank 0's parameters and
buffers once, and the one SUM all-reduce happens in :class:`~lightning_dp.optim.DPOptimizer` before the noise (why:
docs/design.md sections 8 and 12.2). Everything else of ``DDPStrategy`` is kept.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy
from typing_extensions import override

from lightning_dp.lightning.dp_mixin import DPStrategyMixin
from lightning_dp.lightning.registry import register_dp_strategy
from lightning_dp.runtime.distributed import DistributedContext, distributed_context

_DDP_ONLY = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


class DPDDPStrategy(DPStrategyMixin, DDPStrategy):
    """Differentially private training on several processes: global Poisson sampling over the ranks' shards, per-sample
    clipping on each rank, the clipped sums all-reduced, one noise draw per step.

    ``batch_size`` is per process; the default sample rate is ``batch_size * accumulate_grad_batches * W / N``. By name:
    ``"dp_ddp"`` (``target_epsilon=3.0``, ``start_method="popen"``), ``"dp_ddp_epsilon_3"``, ``"dp_ddp_epsilon_8"``.

    Args:
        kwargs: the privacy options (:class:`~lightning_dp.config.PrivacyConfig`, listed in
            :class:`~lightning_dp.lightning.dp_mixin.DPStrategyMixin`) and ``DDPStrategy``'s (``start_method``,
            ``process_group_backend``, ``timeout``, ``cluster_environment``, ...).

    Raises:
        ValueError: the arguments of ``DPStrategy``; a ``start_method`` other than ``"popen"``; DDP communication
            hooks, model averaging or other arguments of ``DistributedDataParallel`` (``find_unused_parameters``,
            ...), since DDP's all-reduce is not used.
        RuntimeError: at the start of training, a dataset, sample rate or noise that differs between ranks.
    """

    strategy_name = "dp_ddp"

    def __init__(self, **kwargs: Any) -> None:
        given = sorted(name for name in _DDP_ONLY if kwargs.get(name) is not None)
        if given:
            raise ValueError(
                f"DPDDPStrategy does not wrap the model in DistributedDataParallel, so {given} would have no effect: "
                "remove them (the clipped gradient sums are all-reduced once per step by the DP optimizer)"
            )
        if kwargs.get("start_method", "popen") != "popen":
            raise ValueError(
                f"DPDDPStrategy(start_method={kwargs['start_method']!r}) would train in child processes whose privacy "
                "ledger never reaches this process (its epsilon would read 0, its checkpoints hold no steps): use "
                "start_method='popen' (the default; run the script itself, or with torchrun)"
            )
        super().__init__(**kwargs)
        if self._ddp_kwargs:
            raise ValueError(
                f"{sorted(self._ddp_kwargs)} are arguments of DistributedDataParallel, which DPDDPStrategy does not "
                "use (see its module docstring): remove them"
            )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"dp_ddp"`` (epsilon 3), ``"dp_ddp_epsilon_3"`` and ``"dp_ddp_epsilon_8"`` (and not the
        ``"ddp*"`` names ``DDPStrategy.register_strategies`` would register for this class)."""
        register_dp_strategy(strategy_registry, cls, cls.strategy_name)

    @override
    def _distributed_context(self) -> DistributedContext | None:
        """The default process group Lightning's ``setup_environment`` initialised."""
        return distributed_context()

    @override
    def configure_ddp(self) -> None:
        """Keep the LightningModule unwrapped and start every rank from rank 0's parameters and buffers."""
        assert self.model is not None
        context = distributed_context()
        if context is not None:
            context.broadcast_module(self.model)
