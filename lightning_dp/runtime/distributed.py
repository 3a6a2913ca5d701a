"""The collectives of DP training on several processes (docs/design.md section 8), framework-agnostic.

One logical step on ``W`` processes is exactly the single-process step on the union of the ranks' examples:

1. each rank Poisson-samples its own shard of the data (:class:`~lightning_dp.data.PoissonBatchSampler` with
   ``rank``/``world_size``) and clips its examples locally into ``p.grad``;
2. the clipped SUMS are all-reduced with ``SUM`` (never ``MEAN``): :meth:`DistributedContext.reduce_clipped_sum`,
   handed to :class:`~lightning_dp.optim.DPOptimizer` as ``reduce_clipped_sum``;
3. noise is drawn ONCE: every rank holds the same noise stream (the base seed is broadcast from rank 0 by
   :meth:`DistributedContext.synchronize_randomness`), so all ranks draw the identical sample and add it to the
   identical reduced sum. Independent per-rank noise would be wrong for every mechanism but a rescaled Gaussian
   (a sum of Laplace or PLRV draws is not Laplace or PLRV) and would make the ranks' parameters diverge;
4. the noisy sum is divided by the global expected batch size ``q N`` and every rank takes the same optimizer
   step, so the parameters stay bit-identical (they start identical: :meth:`DistributedContext.broadcast_module`);
5. every rank records the same event, so the accountants agree; only rank 0 logs
   (:meth:`DistributedContext.log_on_rank_zero_only`).

Nothing here knows Lightning or HuggingFace: both build the context with :func:`distributed_context` once
``torch.distributed`` is initialised (by Lightning's DDP strategy, ``torchrun`` or ``accelerate.PartialState()``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_dp.runtime.randomness import DPRandomness
from lightning_dp.runtime.sharding import is_sharded

log = logging.getLogger("lightning_dp")


class _ErrorsOnly(logging.Filter):
    """Lets through only errors (installed on the ``lightning_dp`` logger of ranks other than 0)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


@dataclass(frozen=True)
class DistributedContext:
    """This process's place in an initialised ``torch.distributed`` process group, and the DP collectives.

    Every method is a collective: all ranks must call it, in the same order.

    Attributes:
        rank: rank of this process in ``group``, in ``[0, world_size)``.
        world_size: number of processes W.
        group: the process group (``None``: the default group).
    """

    rank: int
    world_size: int
    group: Any = None

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that logs."""
        return self.rank == 0

    def _device(self) -> torch.device:
        """The device the backend communicates tensors on (CUDA for NCCL, else CPU)."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def reduce_clipped_sum(self, tensors: Sequence[torch.Tensor]) -> None:
        """All-reduce ``tensors`` in place with SUM: afterwards every rank holds the clipped sum over all ranks.

        Tensors are flattened into one buffer per (device, dtype), so one step costs one collective per buffer.

        Args:
            tensors: the clipped gradient sums ``p.grad`` of one logical step, any shapes, the same list (order,
                shapes, dtypes) on every rank. Sharded ones (FSDP2 ``DTensor``) are left as they are: the clipper
                summed them over the ranks into each rank's shard
                (:func:`lightning_dp.runtime.sharding.sum_into_shard`).
        """
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for tensor in tensors:
            if is_sharded(tensor):  # already the sum over the ranks (the clipper reduce-scattered it)
                continue
            buckets.setdefault((tensor.device, tensor.dtype), []).append(tensor)
        for bucket in buckets.values():
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
            for tensor, reduced in zip(bucket, flat.split([t.numel() for t in bucket]), strict=True):
                tensor.copy_(reduced.view_as(tensor))

    def any_rank(self, flags: Sequence[bool]) -> list[bool]:
        """Each flag OR-ed over all ranks (one MAX all-reduce); call only where every rank gets to, e.g. at the normal
        end of a run, never on an error path (a dead peer would make it wait for the collective's timeout)."""
        return [bool(value) for value in self.max_over_ranks([int(flag) for flag in flags])]

    def max_over_ranks(self, values: Sequence[int]) -> list[int]:
        """Each integer's maximum over all ranks (one MAX all-reduce); the same caveat as :meth:`any_rank`."""
        buffer = torch.tensor(list(values), dtype=torch.int64, device=self._device())
        dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=self.group)
        return [int(value) for value in buffer.tolist()]

    def broadcast_int(self, value: int) -> int:
        """Rank 0's ``value`` (an unsigned 64-bit integer), on every rank."""
        signed = value - 2**64 if value >= 2**63 else value
        buffer = torch.tensor([signed], dtype=torch.int64, device=self._device())
        dist.broadcast(buffer, src=self._global_rank_zero(), group=self.group)
        received = int(buffer.item())
        return received + 2**64 if received < 0 else received

    def _global_rank_zero(self) -> int:
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    def synchronize_randomness(self, randomness: DPRandomness) -> None:
        """Give every rank rank 0's base seed: identical noise streams, distinct Poisson-sampling streams.

        Call it after any :meth:`DPRandomness.restart` (resuming draws fresh entropy on each rank) and before the
        first batch is sampled.
        """
        randomness.share(self.broadcast_int(randomness.base_seed), rank=self.rank)

    def broadcast_module(self, module: nn.Module) -> None:
        """Copy rank 0's parameters and buffers into ``module`` on every rank (the ranks start identical). Sharded
        ones (FSDP2 ``DTensor``) are left as they are: they are one tensor across the ranks and cannot be
        broadcast."""
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                if not is_sharded(tensor):
                    dist.broadcast(tensor.data, src=self._global_rank_zero(), group=self.group)

    def check_identical(self, what: str, value: Any) -> None:
        """Raise ``RuntimeError`` unless every rank passes an equal ``value`` (a picklable object).

        Used for what the noise and the accountant depend on (dataset size, sample rate, mechanism): ranks that
        disagree would add different noise and report different epsilons.
        """
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.group)
        if any(v != values[0] for v in values):
            raise RuntimeError(
                f"The ranks disagree on the {what}: {values}. Every process must see the same dataset and "
                "privacy arguments"
            )

    def log_on_rank_zero_only(self, logger: logging.Logger = log) -> logging.Filter | None:
        """On ranks other than 0, silence ``logger`` below ERROR; returns the filter (for ``removeFilter``).

        Returns ``None`` on rank 0 (nothing to silence).
        """
        if self.is_main:
            return None
        errors_only = _ErrorsOnly()
        logger.addFilter(errors_only)
        return errors_only


def distributed_context(group: Any = None) -> DistributedContext | None:
    """The :class:`DistributedContext` of this process, or ``None`` when ``torch.distributed`` is not initialised.

    Works wherever the default process group exists: Lightning's DDP strategies, ``torchrun``, and
    ``accelerate`` (``accelerate.PartialState()`` initialises it for ``accelerate launch --num_processes W``).

    Args:
        group: a process group of the ranks that train together (default: the whole world).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return DistributedContext(rank=dist.get_rank(group), world_size=dist.get_world_size(group), group=group)
