"""DPDDPStrategy: DP-SGD on several processes (devices or nodes) with Lightning's DDP launcher and process group.

``Trainer(strategy=DPDDPStrategy(noise_multiplier=1.0, max_grad_norm=1.0), devices=2)`` trains the same model
with the same privacy guarantee as one process with the global sample rate (docs/design.md section 8): each rank
Poisson-samples its shard of the data and clips its own examples, the clipped SUMS are all-reduced, noise is drawn
once (the same draw on every rank) and divided by the global expected batch size ``q N``, so every rank takes the
same step and the parameters stay bit-identical. The collectives are in :mod:`lightning_dp.runtime.distributed`, the
DP hooks in :class:`~lightning_dp.lightning.dp_mixin.DPStrategyMixin` (shared with ``DPStrategy``).

Why the module is NOT wrapped in ``DistributedDataParallel``: DDP's purpose is to all-reduce (average) ``p.grad``
from autograd hooks during ``backward``. Under DP that would be wrong twice over: the averaged quantity must be the
clipped SUM, all-reduced exactly once per logical step after the last micro-batch (not once per backward, and
DDP's mean would rescale it by ``1/W``); and DDP's reducer hooks fire on the clipper's own backward passes (ghost
clipping runs two). Keeping DDP and silencing it with ``no_sync()`` everywhere would leave a wrapper whose only
remaining effects are the initial parameter broadcast, a buffer broadcast on each forward, and extra memory for
its buckets. So :meth:`DPDDPStrategy.configure_ddp` leaves the LightningModule unwrapped, broadcasts rank 0's
parameters and buffers once (what DDP's constructor would have done), and the one SUM all-reduce happens in
:class:`~lightning_dp.optim.DPOptimizer` before the noise. Everything else of ``DDPStrategy`` is kept: the
launcher (``start_method``), process group, cluster environments, ``barrier``/``broadcast``/``reduce`` for
metrics, and rank-0-only checkpoint writing.
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
    """Differentially private training on several processes: global Poisson sampling over the ranks' shards,
    per-sample clipping on each rank, the clipped sums all-reduced, one noise draw per step.

    ``batch_size`` of the training loader is per process (as in Lightning); the default sample rate is
    ``batch_size * accumulate_grad_batches * W / N`` for W processes, and the epsilon is the single-process one
    for that rate.

    By name (registered on importing ``lightning_dp``, like ``DPStrategy``'s ``"dp"``):
    ``Trainer(strategy="dp_ddp", devices=2)`` is ``DPDDPStrategy(target_epsilon=3.0)`` with the other arguments at
    their defaults (``start_method="popen"``); ``"dp_ddp_epsilon_3"`` and ``"dp_ddp_epsilon_8"`` name the budget
    explicitly.

    Args:
        kwargs: the privacy options, the fields of :class:`~lightning_dp.config.PrivacyConfig` (documented there
            and in :class:`~lightning_dp.lightning.dp_mixin.DPStrategyMixin`), and those of Lightning's
            ``DDPStrategy`` (``start_method``, ``process_group_backend``, ``timeout``, ``cluster_environment``, ...).

    Raises:
        ValueError: the arguments of ``DPStrategy``; DDP communication hooks or model averaging (they act on
            DDP's gradient all-reduce, which is not used: see the module docstring) or other arguments of
            ``DistributedDataParallel`` (``find_unused_parameters``, ...); a dataset, sample rate or
            noise that differs between ranks (``RuntimeError``, at the start of training).
    """

    strategy_name = "dp_ddp"

    def __init__(self, **kwargs: Any) -> None:
        given = sorted(name for name in _DDP_ONLY if kwargs.get(name) is not None)
        if given:
            raise ValueError(
                f"DPDDPStrategy does not wrap the model in DistributedDataParallel, so {given} would have no effect: "
                "remove them (the clipped gradient sums are all-reduced once per step by the DP optimizer)"
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
