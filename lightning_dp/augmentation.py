"""The two helpers of a training step with augmentation multiplicity (De, Berrada, Hayes, Smith and Balle 2022,
"Unlocking high-accuracy differentially private image classification through scale", Section 3.2).

With ``augmentation_multiplicity = K`` the step receives the ``B`` sampled examples, copies, augments and returns one
loss per example, the mean of its copies' losses::

    x, y = repeat_for_multiplicity(batch, K)              # [B K, ...], rows i K .. i K + K - 1 are example i's
    if self.training:                                      # like dropout: off in eval mode
        x = augment(x)                                     # per row, e.g. random crop and flip
    rows = F.cross_entropy(self(x), y, reduction="none")   # [B K]
    return augmentation_mean(rows, K)                      # [B]

One example's sensitivity stays ``C`` whatever ``K``, provided every row stays in place (rows ``i K .. i K + K - 1``
are example ``i``'s copies; a copy-major loop such as ``torch.cat([aug(x[k::K]) for k in range(K)])`` breaks this,
up to ``K C``, and the checks cannot always see it; :func:`augment_each_example` cannot move rows). Draw randomness
from torch's global RNG or a generator seeded from the micro-batch's position, never from one that advances between
re-runs. Why each rule, and what the checks see: docs/design.md section 4.8.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from lightning_utilities.core.apply_func import apply_to_collection

from lightning_dp.clipping.multiplicity import validate_multiplicity
from lightning_dp.data.batch_tensors import batch_tensors
from lightning_dp.data.example_lists import EXAMPLE_SEQUENCES, ValueSequence, example_sequences, select_examples

Batch = TypeVar("Batch")


def repeat_for_multiplicity(batch: Batch, multiplicity: int) -> Batch:
    """``multiplicity`` copies of every example of ``batch``, in sample-major order.

    Args:
        batch: a tensor ``[B, ...]`` or any nesting of tuples, lists, dicts (``BatchEncoding`` included) and
            dataclasses holding tensors, their first dimension the examples.
        multiplicity: ``K >= 1``.

    Returns:
        The same structure with every tensor of at least one dimension repeated along its first dimension as
        ``tensor.repeat_interleave(K, 0)`` does: ``[B K, ...]``, rows ``i K .. i K + K - 1`` copies of row ``i``
        (a new tensor, differentiable), and every per-example sequence the Poisson loader marked
        (:mod:`lightning_dp.data.example_lists`) with each entry repeated ``K`` times in place. Scalars (0-dim tensors)
        and other non-tensors are left as they are; ``K = 1`` returns ``batch`` itself.

    Raises:
        ValueError: ``multiplicity`` not an integer >= 1; for ``K > 1``, tensors (of at least one dimension) whose
            first dimensions differ (one of them is not ``B``, e.g. ``position_ids`` of shape ``[1, T]``).
    """
    validate_multiplicity(multiplicity)
    if multiplicity == 1:
        return batch
    sizes = [t.shape[0] for t in batch_tensors(batch, min_ndim=1)] + [len(s) for s in example_sequences(batch)]
    if len(set(sizes)) > 1:
        raise ValueError(
            f"repeat_for_multiplicity: every tensor's first dimension must be the batch's examples, got first "
            f"dimensions {sizes} (a tensor shared by the rows, e.g. position_ids of shape [1, T], would be repeated as "
            f"if it were an example): expand it to [B, ...] first, or add it after the copies"
        )

    def repeat(value: torch.Tensor | ValueSequence) -> Any:
        if isinstance(value, torch.Tensor):
            return value if value.ndim == 0 else value.repeat_interleave(multiplicity, dim=0)
        return type(value)(entry for entry in value for _ in range(multiplicity))

    return apply_to_collection(batch, (torch.Tensor, *EXAMPLE_SEQUENCES), repeat)


def augment_each_example(rows: Batch, multiplicity: int, fn: Callable[[Batch], Batch]) -> Batch:
    """Apply ``fn`` to each example's ``multiplicity`` copies on their own, keeping every row in place.

    Args:
        rows: the copies, as :func:`repeat_for_multiplicity` returns them (``[B K, ...]`` or a nesting of tuples,
            lists, dicts and dataclasses of such tensors; 0-dim tensors and non-tensors pass through to ``fn``).
        multiplicity: ``K >= 1``.
        fn: receives one example's copies (every tensor ``[K, ...]``, every marked per-example sequence ``K``
            entries) and returns them augmented: the same structure, every tensor of ``K`` rows with its dtype and its
            shape beyond the rows kept (an empty Poisson draw passes its copies through without calling ``fn``), the
            marked sequences kept marked. The result's other values (0-dim tensors, non-tensors) are taken from the
            first example's result: return only the copies. Called once per example: vectorise inside ``fn``.

    Returns:
        ``rows`` with each example's slice replaced by ``fn``'s result, in sample-major order.

    Raises:
        ValueError: ``multiplicity`` not an integer >= 1; a batch with neither a tensor of one dimension or more nor a
            marked per-example sequence (nothing to split into examples); a tensor whose first dimension, or a marked
            sequence whose length, is not a multiple of ``K`` or differs from the others'; ``fn`` returned another
            number of tensors or marked sequences, a tensor without ``K`` rows or with another dtype or shape beyond
            its rows, or a marked sequence without ``K`` entries.
    """
    validate_multiplicity(multiplicity)
    leaves, entries = batch_tensors(rows, min_ndim=1), example_sequences(rows)
    sizes = [t.shape[0] for t in leaves] + [len(sequence) for sequence in entries]
    if not sizes:
        raise ValueError(
            "augment_each_example: the batch has no tensor of one dimension or more and no per-example list to split "
            "into each example's copies (a list the Poisson loader did not mark is not one): return tensors from the "
            "training loader"
        )
    total = sizes[0]
    if any(size != total for size in sizes) or total % multiplicity:
        raise ValueError(
            f"augment_each_example needs every tensor of [B*K, ...] rows and every per-example list of B*K entries "
            f"with K={multiplicity}, got sizes {sizes}"
        )
    if total == 0:  # an empty Poisson draw: no example to augment
        return rows
    parts: list[list[torch.Tensor]] = []
    entry_parts: list[list[ValueSequence]] = []
    template: Any = None
    for start in range(0, total, multiplicity):
        result = fn(select_examples(rows, total, slice(start, start + multiplicity)))
        template = result if template is None else template
        out, out_entries = batch_tensors(result, min_ndim=1), example_sequences(result)
        kinds = [(t.dtype, tuple(t.shape[1:])) for t in leaves]
        if (
            [(t.dtype, tuple(t.shape[1:])) for t in out] != kinds
            or any(t.shape[0] != multiplicity for t in out)
            or [len(sequence) for sequence in out_entries] != [multiplicity] * len(entries)
        ):
            raise ValueError(
                f"augment_each_example: fn must return the same structure, every tensor of K={multiplicity} rows with "
                "its dtype and shape beyond the rows (an empty draw passes the copies through unchanged) and every "
                f"per-example list of K entries; it was given {_described(leaves, entries)} for all the copies and "
                f"returned {_described(out, out_entries)} for one example's"
            )
        parts.append(out)
        entry_parts.append(out_entries)
    joined = iter([torch.cat([p[j] for p in parts]) for j in range(len(leaves))])
    joined_entries = iter([type(entries[j])(entry for p in entry_parts for entry in p[j]) for j in range(len(entries))])

    def join(value: torch.Tensor | ValueSequence) -> Any:
        if isinstance(value, torch.Tensor):
            return value if value.ndim == 0 else next(joined)
        return next(joined_entries)

    return apply_to_collection(template, (torch.Tensor, *EXAMPLE_SEQUENCES), join)


def _described(tensors: list[torch.Tensor], sequences: list[ValueSequence]) -> str:
    shapes = [(str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape)) for tensor in tensors]
    return f"tensors {shapes} and lists of {[len(sequence) for sequence in sequences]} entries"


def augmentation_mean(loss_rows: torch.Tensor, multiplicity: int) -> torch.Tensor:
    """Each example's loss: the mean of its ``multiplicity`` copies' losses (De et al. 2022, Section 3.2).

    Args:
        loss_rows: ``[B K]``, one loss per row of the forward, in sample-major order (rows ``i K .. i K + K - 1``
            are example ``i``'s, as :func:`repeat_for_multiplicity` makes them).
        multiplicity: ``K >= 1``.

    Returns:
        ``[B]``, ``loss_i = (1/K) sum_k loss_rows[i K + k]`` (differentiable; ``loss_rows`` itself for ``K = 1``).

    Raises:
        ValueError: ``multiplicity`` not an integer >= 1; ``loss_rows`` not one-dimensional or of a length that is
            not a multiple of ``K``.
    """
    validate_multiplicity(multiplicity)
    if not isinstance(loss_rows, torch.Tensor) or loss_rows.ndim != 1 or loss_rows.shape[0] % multiplicity:
        shape: Any = tuple(loss_rows.shape) if isinstance(loss_rows, torch.Tensor) else type(loss_rows).__name__
        raise ValueError(
            f"augmentation_mean needs one loss per row of the forward, shape [B*K] with K={multiplicity}, got {shape}: "
            "reduce token losses per row first (reduction='none', then a mean over each row's tokens)"
        )
    if multiplicity == 1:
        return loss_rows
    return loss_rows.reshape(-1, multiplicity).mean(1)
