"""The physical batch cap (``max_physical_batch_size``, Opacus's name): each training micro-batch, whose Poisson size
varies with the draw, runs in as many forward/backward passes of at most ``cap`` examples as it needs.

The loader still yields one (possibly large) Poisson micro-batch per accumulation step; the adapter splits it here
(:func:`physical_batches`, with :func:`~lightning_dp.data.physical_batches.split_rows`) and runs the passes
(:func:`run_physical_batches`), each pass's clipped sum accumulating in ``p.grad`` as the micro-batches' already do, so
the noise is still drawn once per logical step and the accountant is unchanged (docs/design.md section 2.2). On an
FSDP2-sharded model every rank runs the largest pass count of the ranks, padding with the engine's stand-in batch,
which adds exactly zero (section 8.1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lightning_dp.clipping.float32_sums import add_float32_sum, pop_float32_sum, put_float32_sum
from lightning_dp.data.example_lists import refuse_plain_sequences
from lightning_dp.data.physical_batches import part_sizes, split_rows
from lightning_dp.engine.adapter import micro_batch

if TYPE_CHECKING:
    from lightning_dp.engine.adapter import TrainerAdapter

#: One pass: ``(batch, size, stand_in)`` as :func:`~lightning_dp.engine.adapter.micro_batch` returns it.
PhysicalBatch = tuple[Any, int | None, bool]


def physical_batches(
    adapter: TrainerAdapter, batch: Any, to_device: Callable[[Any], Any] | None = None
) -> list[PhysicalBatch]:
    """The passes one training micro-batch runs in: :data:`PhysicalBatch` tuples.

    A batch holding a plain list or tuple where the Poisson loader's hold a marked one (a hook rebuilt it) is refused
    first, at every batch (:func:`~lightning_dp.data.example_lists.refuse_plain_sequences`).

    Without a cap: ``[micro_batch(adapter, batch, to_device)]``, the micro-batch itself (a stand-in when empty on a
    sharded model). With ``max_physical_batch_size = c``: ``max(1, ceil(B / c))`` parts of at most ``c`` examples (an
    empty batch: itself, once); on an FSDP2-sharded model the count is the maximum over the ranks (one MAX
    all-reduce per micro-batch) and a rank with fewer parts runs the stand-in batch (moved by ``to_device``) for the
    rest, since every rank must join every pass's collectives.

    Raises:
        ValueError: with a cap, a batch whose size the adapter cannot read, or that :func:`split_rows` cannot split; a
            plain list or tuple where the loader's batches hold a marked one.
    """
    engine = adapter.privacy_engine
    refuse_plain_sequences(batch, engine.example_paths)
    cap = engine.config.max_physical_batch_size
    if cap is None:
        return [micro_batch(adapter, batch, to_device)]
    size = adapter.read_batch_size(batch)
    if size is None:
        raise ValueError(
            f"max_physical_batch_size={cap} splits each training batch by its number of examples, which cannot be "
            "read from it: return tensors with the examples along their first dimension, or remove the cap"
        )
    passes: list[PhysicalBatch] = [
        (part, length, False) for part, length in zip(split_rows(batch, size, cap), part_sizes(size, cap), strict=True)
    ]
    if not engine.every_rank_runs_every_step:
        return passes or [(batch, size, False)]  # an empty batch: one pass, handled as without a cap
    count = max(len(passes), 1)
    if engine.distributed is not None:
        (count,) = engine.distributed.max_over_ranks([count])
    while len(passes) < count:
        stand_in = engine.stand_in_batch()
        if to_device is not None:
            stand_in = to_device(stand_in)
        passes.append((stand_in, adapter.read_batch_size(stand_in), True))
    return passes


@dataclass
class PhysicalLosses:
    """What :func:`run_physical_batches` leaves.

    Attributes:
        loss_sum: the detached sum (0-dim) of the per-sample losses the passes clipped, stand-ins excluded; ``None``
            when none.
        count: how many losses that sum holds.
        deferred: with ``defer_last``, the last pass's per-sample loss ``[B]`` (attached to the graph, not yet clipped)
            and whether that pass is a stand-in; ``None`` when the last pass returned no loss.
    """

    loss_sum: torch.Tensor | None = None
    count: int = 0
    deferred: tuple[torch.Tensor, bool] | None = None

    def mean(self, device: torch.device | str) -> torch.Tensor:
        """The mean per-sample loss over the micro-batch's examples, stand-ins excluded (0-dim; 0 when none): with a
        :attr:`deferred` loss, attached to the graph through it (Lightning's closure loss), else on ``device``."""
        if self.deferred is None:
            if self.loss_sum is None or not self.count:
                return torch.zeros((), device=device)
            return (self.loss_sum / self.count).to(device)
        loss, stand_in = self.deferred
        real = loss[:0] if stand_in else loss
        count, total = self.count + real.numel(), real.sum()
        if self.loss_sum is not None:
            total = total + self.loss_sum
        return total / count if count else loss.sum() * 0


def run_physical_batches(
    passes: Sequence[PhysicalBatch],
    per_sample_loss: Callable[[Any, int | None, bool], torch.Tensor | None],
    clip: Callable[..., torch.Tensor],
    *,
    defer_last: bool,
) -> PhysicalLosses:
    """Run each pass's forward (``per_sample_loss(batch, size, stand_in) -> [B]`` or ``None``: the pass is skipped)
    and clip it (``clip(loss, stand_in=...)``, adding its clipped sum into ``p.grad``) before the next pass's forward,
    so at most one pass's activations are alive.

    Args:
        passes: from :func:`physical_batches`.
        per_sample_loss: one pass's per-sample losses.
        clip: the engine's :meth:`~lightning_dp.engine.privacy_engine.PrivacyEngine.clip`.
        defer_last: leave the last pass's loss unclipped in :attr:`PhysicalLosses.deferred` (the framework's backward
            clips it).
    """
    result = PhysicalLosses()
    for index, (batch, size, stand_in) in enumerate(passes):
        loss = per_sample_loss(batch, size, stand_in)
        if loss is None:
            continue
        if defer_last and index == len(passes) - 1:
            result.deferred = (loss, stand_in)
            break
        clip(loss, stand_in=stand_in)
        if not stand_in and loss.numel():
            total = loss.detach().sum()
            result.loss_sum = total if result.loss_sum is None else result.loss_sum + total.to(result.loss_sum.device)
            result.count += loss.numel()
    return result


#: What :func:`hold_gradients` takes out of a parameter, or :func:`swap_gradients` keeps aside: its ``.grad`` and,
#: for a 16-bit parameter, its float32 clipped sum (:mod:`lightning_dp.clipping.float32_sums`).
Held = tuple[torch.Tensor | None, torch.Tensor | None]


def hold_gradients(params: Sequence[torch.nn.Parameter]) -> list[Held]:
    """Take every ``p.grad`` (and float32 sum) out (``p.grad = None``) and return them, so that passes run now
    accumulate their clipped sums apart (:func:`swap_gradients` puts them back)."""
    held = [(p.grad, pop_float32_sum(p)) for p in params]
    for p in params:
        p.grad = None
    return held


def swap_gradients(params: Sequence[torch.nn.Parameter], held: Sequence[Held]) -> list[Held]:
    """Put the gradients (and float32 sums) :func:`hold_gradients` took back and return what the parameters held
    meanwhile (the passes' clipped sums; ``None`` where nothing was added).

    Lightning zeroes the gradients between its ``training_step`` and its backward on a logical step's first
    micro-batch (and :class:`~lightning_dp.optim.DPOptimizer`'s ``zero_grad`` drops the float32 sums): the sums of the
    passes run inside the step are kept aside and added back by :func:`add_gradients` after it (and whatever
    ``on_before_zero_grad`` sees is what it would see without the cap)."""
    sums = [(p.grad, pop_float32_sum(p)) for p in params]
    for p, (grad, kept) in zip(params, held, strict=True):
        p.grad = grad
        if kept is not None:
            put_float32_sum(p, kept)
    return sums


def add_gradients(params: Sequence[torch.nn.Parameter], sums: Sequence[Held]) -> None:
    """``p.grad += sum`` for each kept sum of :func:`swap_gradients` (``p.grad = sum`` where ``p.grad`` is ``None``),
    and each kept float32 sum added to the parameter's (:func:`~lightning_dp.clipping.float32_sums.add_float32_sum`)."""
    for p, (grad, kept) in zip(params, sums, strict=True):
        if kept is not None:
            add_float32_sum(p, kept)
        if grad is None:
            continue
        if p.grad is None:
            p.grad = grad
        else:
            p.grad.add_(grad)
