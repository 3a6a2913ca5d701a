"""DPModelParallelStrategy: DP-SGD on an FSDP2-sharded model (``fully_shard``) with Lightning's ModelParallelStrategy.

``Trainer(strategy=DPModelParallelStrategy(noise_multiplier=1.0), devices=W)`` trains a model that the
LightningModule shards in ``configure_model`` with ``fully_shard(..., mesh=self.device_mesh["data_parallel"])``,
with the guarantee of one process at the global sample rate (docs/design.md sections 8 and 8.1): each rank
Poisson-samples its shard of the data at the global rate q, the clipper sums the clipped per-sample gradients over
the ranks into each rank's parameter shard (one reduce-scatter per parameter and micro-batch), each shard gets the
noise once from its own stream, and the optimizer steps on the shards. The DP hooks are those of
:class:`~lightning_dp.lightning.dp_mixin.DPStrategyMixin`; the engine does the sharded parts
(:mod:`lightning_dp.runtime.sharding`). Everything else of Lightning's ``ModelParallelStrategy`` is kept: the launcher,
process group, device mesh, sharded (DCP) or full checkpoints.
"""

from __future__ import annotations

import inspect
from typing import Any, Literal

from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import ModelParallelStrategy
from typing_extensions import override

from lightning_dp.config import option_parameters
from lightning_dp.lightning.dp_mixin import DPStrategyMixin
from lightning_dp.lightning.registry import register_dp_strategy
from lightning_dp.runtime.distributed import DistributedContext, distributed_context


class DPModelParallelStrategy(DPStrategyMixin, ModelParallelStrategy):
    """Differentially private training of an FSDP2-sharded model: global Poisson sampling over the ranks' shards of
    the data, per-sample clipping on each rank, the clipped sums summed into the parameter shards, noise once per
    coordinate.

    The LightningModule shards its model in ``configure_model`` (required by ``ModelParallelStrategy``), e.g.
    ``fully_shard(layer, mesh=self.device_mesh["data_parallel"])`` for each block, then on the root, and its
    ``training_step`` returns the PER-SAMPLE loss ``[B]`` as with :class:`~lightning_dp.DPStrategy`. ``batch_size``
    of the training loader is per process; the default sample rate is ``batch_size * accumulate_grad_batches * W /
    N`` for W processes, and the epsilon is the single-process one for that rate. Every rank must start from the
    same initial model: seed the model's initialisation (e.g. ``torch.manual_seed`` before building it, or
    ``seed_everything``). The sharded parameters are one tensor across the ranks (each coordinate is held by one
    rank, so there is nothing to compare), and the parameters and buffers that are not sharded are copied from
    rank 0 at setup (as ``DPDDPStrategy`` does); a ``DTensor`` cannot be broadcast, so a sharded model whose ranks
    were initialised differently trains, consistently, on a mixture of the ranks' initial shards (under HSDP, where
    ranks hold replicas, such replicas would start, and stay, different).

    Only data parallelism: ``tensor_parallel_size`` must be 1 (DP over tensor-parallel layers is not supported:
    the per-sample terms of a layer would be split across ranks), and ``data_parallel_size`` defaults to the number
    of processes.

    Per-sample momentum (``momentum_length > 1``: the stored iterates are kept as shards, gathered into the
    checkpoints) and the low-pass filter work as on an unsharded model (docs/design.md section 8.1). The run-time
    checks run as on one process; the batch-independence checks (first step, and every N steps with
    ``check_batch_independence_every``), whose extra passes gather weights, run in lockstep over the ranks (a rank
    with an empty or one-example batch joins the passes), and mixing found on one rank stops every rank.

    By name: ``Trainer(strategy="dp_fsdp", devices=2)`` is ``DPModelParallelStrategy(target_epsilon=3.0)`` with the
    other arguments at their defaults; ``"dp_fsdp_epsilon_3"`` and ``"dp_fsdp_epsilon_8"`` name the budget
    explicitly (:mod:`lightning_dp.lightning.registry`).

    Checkpoints are Lightning's ``ModelParallelStrategy`` ones with the privacy state added: a folder per
    checkpoint (``torch.distributed.checkpoint``, each rank writes its shards; ``meta.pt`` holds the non-tensor
    entries, the privacy state ``checkpoint["lightning_dp"]`` among them), or with
    ``save_distributed_checkpoint=False`` one file with the full state written by rank 0. ``ckpt_path=`` resumes
    either, continuing the privacy ledger (epsilon and the step count). Unlike the single-file checkpoints of
    ``DPStrategy``/``DPDDPStrategy``, a sharded checkpoint is not written atomically: a process killed while
    writing it leaves a folder that may not load (``meta.pt`` is written last); keep more than one checkpoint
    (``ModelCheckpoint(save_top_k=...)``).

    Using the model after training (e.g. ``generate``), two ways that work with FSDP2:

    - gather the full weights, a collective on every rank, and load them into an unsharded model on one rank::

        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        full = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if trainer.global_rank == 0:  # only rank 0 receives the tensors
            plain = LlamaForCausalLM(config)
            plain.load_state_dict(full)
            plain.generate(...)

    - or call ``module.model.generate(..., synced_gpus=True)`` on the sharded model on EVERY rank: each forward
      gathers the weights, so a rank that stopped early would leave the others waiting; HF's ``synced_gpus`` keeps
      every rank running forwards until all are done (or generate the same number of new tokens everywhere,
      ``min_new_tokens == max_new_tokens``).

    Args:
        data_parallel_size: the number of processes that shard the model; default (``"auto"``): all of them.
        tensor_parallel_size: must be 1.
        kwargs: the other privacy options, the fields of :class:`~lightning_dp.config.PrivacyConfig` (documented
            there and in :class:`~lightning_dp.lightning.dp_mixin.DPStrategyMixin`), and those of Lightning's
            ``ModelParallelStrategy`` (``save_distributed_checkpoint``, ``process_group_backend``, ``timeout``).

    Raises:
        ValueError: the arguments of ``DPStrategy``; ``tensor_parallel_size`` other than 1; a dataset, sample rate
            or noise that differs between ranks (``RuntimeError``, at the start of training).
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
