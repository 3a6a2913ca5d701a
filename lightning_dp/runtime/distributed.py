"""The collectives of DP training on several processes, framework-agnostic (docs/design.md section 8).

One logical step on ``W`` processes equals the single-process step on the union of the ranks' examples: SUM
all-reduce of the clipped sums (:meth:`DistributedContext.reduce_clipped_sum`), one identical noise draw (shared
base seed, :meth:`DistributedContext.synchronize_randomness`), identical parameters
(:meth:`DistributedContext.broadcast_module`). Built by :func:`distributed_context` once ``torch.distributed`` is
initialised.
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
        """All-reduce ``tensors`` in place with SUM (one collective per (device, dtype) buffer).

        Args:
            tensors: the clipped sums ``p.grad`` of one logical step, the same list (order, shapes, dtypes) on every
                rank; sharded ones (``DTensor``) are left as they are
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
        """Each flag OR-ed over all ranks (one MAX all-reduce); never call it on an error path (a dead peer blocks
        it)."""
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

    def broadcast_object(self, value: Any) -> Any:
        """Rank 0's ``value`` (picklable), on every rank."""
        values = [value]
        dist.broadcast_object_list(values, src=self._global_rank_zero(), group=self.group)
        return values[0]

    def _global_rank_zero(self) -> int:
        return dist.get_global_rank(self.group, 0) if self.group is not None else 0

    def synchronize_randomness(self, randomness: DPRandomness) -> None:
        """Give every rank rank 0's base seed: identical noise streams, distinct sampling streams. Call after any
        :meth:`DPRandomness.restart` and before the first batch is sampled.
        """
        randomness.share(self.broadcast_int(randomness.base_seed), rank=self.rank)

    def broadcast_module(self, module: nn.Module) -> None:
        """Copy rank 0's parameters and buffers into ``module`` on every rank (sharded ``DTensor`` ones are left as they
        are)."""
        with torch.no_grad():
            for tensor in [*module.parameters(), *module.buffers()]:
                if not is_sharded(tensor):
                    dist.broadcast(tensor.data, src=self._global_rank_zero(), group=self.group)

    def gather_objects(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (picklable; tensors in CPU memory), in rank order, on every rank."""
        values: list[Any] = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.group)
        return values

    def check_identical(self, what: str, value: Any) -> None:
        """Raise ``RuntimeError`` unless every rank passes an equal (picklable) ``value``, e.g. N, q or the
        mechanism."""
        values = self.gather_objects(value)
        if any(v != values[0] for v in values):
            raise RuntimeError(
                f"The ranks disagree on the {what}: {values}. Every process must see the same dataset and "
                "privacy arguments"
            )

    def log_on_rank_zero_only(self, logger: logging.Logger = log) -> logging.Filter | None:
        """On ranks other than 0, silence ``logger`` below ERROR; returns the filter (for ``removeFilter``), ``None`` on
        rank 0."""
        if self.is_main:
            return None
        errors_only = _ErrorsOnly()
        logger.addFilter(errors_only)
        return errors_only


def distributed_context(group: Any = None) -> DistributedContext | None:
    """The :class:`DistributedContext` of this process, or ``None`` when ``torch.distributed`` is not initialised
    (Lightning's DDP, ``torchrun``, ``accelerate launch``).

    Args:
        group: a process group of the ranks that train together (default: the whole world).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return DistributedContext(rank=dist.get_rank(group), world_size=dist.get_world_size(group), group=group)
