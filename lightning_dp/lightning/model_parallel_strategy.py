"""DPModelParallelStrategy: DP-SGD on an FSDP2-sharded model (``fully_shard``) with Lightning's ModelParallelStrategy.

The guarantee is that of one process at the global sample rate (docs/design.md sections 8 and 8.1); the DP hooks are
those of :class:`~lightning_dp.lightning.dp_mixin.DPStrategyMixin`, the sharded parts are in
:mod:`lightning_dp.runtime.sharding`.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_dp.config import option_parameters
from lightning_dp.engine.weight_loads import check_checkpoint_keys, trainable_weights_written
from lightning_dp.lightning.checkpoint_checks import unreadable
from lightning_dp.lightning.dp_mixin import DPStrategyMixin
from lightning_dp.lightning.registry import register_dp_strategy
from lightning_dp.runtime.distributed import DistributedContext, distributed_context


class DPModelParallelStrategy(DPStrategyMixin, ModelParallelStrategy):
    """Differentially private training of an FSDP2-sharded model (data parallelism only).

    The LightningModule shards its model in ``configure_model`` (e.g. ``fully_shard(layer,
    mesh=self.device_mesh["data_parallel"])`` per block, then the root), and its ``training_step`` returns the
    PER-SAMPLE loss ``[B]``. ``batch_size`` is per process; the default sample rate is ``batch_size *
    accumulate_grad_batches * W / N``. Every rank must start from the same initial model (seed its initialisation):
    unsharded parameters and buffers are copied from rank 0, but a ``DTensor`` cannot be broadcast. Per-sample momentum,
    the low-pass filter and the run-time checks work as unsharded (docs/design.md section 8.1). By name: ``"dp_fsdp"``
    (``target_epsilon=3.0``), ``"dp_fsdp_epsilon_3"``, ``"dp_fsdp_epsilon_8"`` (:mod:`lightning_dp.lightning.registry`).

    Checkpoints are ``ModelParallelStrategy``'s with the privacy state added (``checkpoint["lightning_dp"]``);
    ``ckpt_path=`` resumes the ledger. A sharded (folder) checkpoint is NOT written atomically: keep more than one
    (``ModelCheckpoint(save_top_k=...)``). Using the model after training (gathering the weights, ``generate`` with
    ``synced_gpus=True``): docs/design.md section 12.2.

    Args:
        data_parallel_size: the number of processes that shard the model; default (``"auto"``): all of them.
        tensor_parallel_size: must be 1 (per-sample terms of a tensor-parallel layer would be split across ranks).
        kwargs: the privacy options (:class:`~lightning_dp.config.PrivacyConfig`, listed in
            :class:`~lightning_dp.lightning.dp_mixin.DPStrategyMixin`) and ``ModelParallelStrategy``'s
            (``save_distributed_checkpoint``, ``process_group_backend``, ``timeout``).

    Raises:
        ValueError: the arguments of ``DPStrategy``; ``tensor_parallel_size`` other than 1.
        RuntimeError: at the start of training, a dataset, sample rate or noise that differs between ranks.
    """

    strategy_name = "dp_fsdp"

    def __init__(
        self,
        *,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: int = 1,
        **kwargs: Any,
    ) -> None:
        if tensor_parallel_size != 1:
            raise ValueError(
                f"{type(self).__name__}(tensor_parallel_size={tensor_parallel_size!r}): differentially private "
                "training over tensor parallelism is not supported (a tensor-parallel layer splits each example's "
                "gradient across ranks, which the per-sample clipping does not combine). Use tensor_parallel_size=1: "
                "the model is then sharded over all processes with fully_shard (data parallelism)"
            )
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tensor_parallel_size,
            **kwargs,
        )

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"dp_fsdp"`` (epsilon 3), ``"dp_fsdp_epsilon_3"`` and ``"dp_fsdp_epsilon_8"``."""
        register_dp_strategy(strategy_registry, cls, cls.strategy_name)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """As :meth:`DPStrategyMixin.load_checkpoint`; ``ModelParallelStrategy`` loads the weights and the
        optimizers' states while it reads the checkpoint, before the privacy state is checked, so the load counts as
        begun first (``CheckpointState.begin_load``): after a refusal, a fit that loads no checkpoint is refused too
        (it would train the checkpoint's weights on this run's ledger), and so is writing a checkpoint, after the load
        of a checkpoint without privacy state too; and so is a load (``strict_loading=False``) that leaves a trainable
        parameter as it was (:func:`~lightning_dp.engine.weight_loads.trainable_weights_written`), or, for a
        checkpoint in one file, whose privacy state comes with weights that lack a trainable parameter: Lightning's
        non-strict load of such a file writes a missing weight with its own value
        (:func:`~lightning_dp.engine.weight_loads.check_checkpoint_keys`).

        Raises:
            ValueError: as :meth:`DPStrategyMixin.load_checkpoint`; with ``strict_loading=False``, a one-file
                checkpoint that cannot be read, or whose privacy state comes with weights that lack a trainable
                parameter.
        """
        self.privacy_engine.checkpoint.begin_load()
        path = Path(checkpoint_path)
        # only a non-strict load of one file fills a missing weight in: a strict one, and a DCP folder's whatever
        # strict_loading says, refuse it themselves (so the file is not read twice then)
        if path.is_file() and not self.lightning_module.strict_loading:
            try:
                saved = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only is True)
            except Exception as error:  # noqa: BLE001 - as the mixin's read: damaged files fail in many ways
                raise unreadable(path, error) from error
            if "lightning_dp" in saved:
                check_checkpoint_keys(self.lightning_module, saved.get("state_dict", {}).keys())
            del saved
        with trainable_weights_written(self.lightning_module):
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        if "lightning_dp" in checkpoint:  # the weights, the optimizers' states and their privacy state are in
            self.privacy_engine.checkpoint.end_load()
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Nothing, as ``ModelParallelStrategy`` (:meth:`load_checkpoint` loaded the weights)."""
        ModelParallelStrategy.load_model_state_dict(self, checkpoint, strict=strict)

    @override
    def _distributed_context(self) -> DistributedContext | None:
        """The default process group Lightning's ``setup_environment`` initialised (the data-parallel group, as the
        tensor-parallel size is 1)."""
        return distributed_context()

    @override
    def setup_environment(self) -> None:
        """As ``ModelParallelStrategy``, with ``data_parallel_size="auto"`` meaning every process (Lightning's own
        ``"auto"`` is the number of nodes, with the rest for tensor parallelism)."""
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    @override
    def model_to_device(self) -> None:
        """Move the module (``ModelParallelStrategy.setup`` calls this after materialising it), then copy rank 0's
        parameters and buffers that are not sharded to every rank: their clipped sums are all-reduced like
        ``DPDDPStrategy``'s, which needs identical copies. Sharded ones (``DTensor``) are one tensor across the
        ranks already and cannot be broadcast."""
        super().model_to_device()
        context = distributed_context()
        if context is not None:
            assert self.model is not None
            context.broadcast_module(self.model)

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The wrapped optimizer's state, as ``ModelParallelStrategy`` collects it. Collected from the user's
        optimizer, never the ``DPOptimizer`` around it: torch's ``get_optimizer_state_dict`` runs ``step()`` on
        an optimizer without state (e.g. plain SGD) to create it, which on a ``DPOptimizer`` would add noise and
        record a privacy step."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        return super().optimizer_state(getattr(optimizer, "original_optimizer", optimizer))

    @override
    def _write_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any) -> None:
        """``ModelParallelStrategy.save_checkpoint``: a folder of shards (DCP) with ``meta.pt``, or one full file
        (``save_distributed_checkpoint=False``); the privacy state is in ``checkpoint`` already."""
        ModelParallelStrategy.save_checkpoint(self, checkpoint, filepath, storage_options)


DPModelParallelStrategy.__init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        *option_parameters(),
        *(
            p
            for name, p in inspect.signature(DPModelParallelStrategy.__init__).parameters.items()
            if name in ("data_parallel_size", "tensor_parallel_size")
        ),
        inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD, annotation=Any),
    ]
)
