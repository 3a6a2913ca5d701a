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

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
from lightning_utilities.core.apply_func import apply_to_collection, is_dataclass_instance

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
            entries) and returns them augmented: the same keys and containers, the same 0-dim tensors and other values
            (the same objects, unchanged; 0-dim tensors are each call's own clones), every tensor of ``K`` rows (its
            dtype and other dimensions may change, alike for every example), every marked sequence of ``K`` entries
            of the same types. Called once per example (vectorise inside ``fn``) and, at every draw, once on zero
            copies, which is all an empty Poisson draw has: each example's tensors must match that call's dtypes and
            shapes beyond the rows. Other values (a numpy array) are shared: do not change them.

    Returns:
        ``rows`` (its structure and other values) with each example's rows and marked entries replaced by ``fn``'s,
        in sample-major order.

    Raises:
        ValueError: ``multiplicity`` not an integer >= 1; a batch with neither a tensor of one dimension or more nor a
            marked per-example sequence (nothing to split into examples); a tensor whose first dimension, or a marked
            sequence whose length, is not a multiple of ``K`` or differs from the others'; ``fn`` returned anything
            else than the copies it was given, augmented (see ``fn``), or tensors whose dtypes or shapes beyond the
            rows differ from those it returned for zero copies; each checked at every draw.
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
    # fn runs on zero copies at every draw (all an empty draw has), and each example's result must match its kinds
    template = _augmented(fn, select_examples(rows, total, slice(0, 0)), multiplicity)
    kinds = [(t.dtype, tuple(t.shape[1:])) for t in batch_tensors(template, min_ndim=1)]
    results = [template] if total == 0 else []
    for start in range(0, total, multiplicity):
        result = _augmented(fn, select_examples(rows, total, slice(start, start + multiplicity)), multiplicity)
        if [(t.dtype, tuple(t.shape[1:])) for t in batch_tensors(result, min_ndim=1)] != kinds:
            raise ValueError(
                "augment_each_example: fn must give every example's copies, and the zero copies of an empty draw, "
                f"tensors of the same dtypes and shapes beyond the rows: {kinds} for zero copies, "
                f"{[(t.dtype, tuple(t.shape[1:])) for t in batch_tensors(result, min_ndim=1)]} for an example's"
            )
        results.append(result)
    parts = [batch_tensors(result, min_ndim=1) for result in results]
    entry_parts = [example_sequences(result) for result in results]
    joined = iter([torch.cat([p[j] for p in parts]) for j in range(len(leaves))])
    joined_entries = iter([type(entries[j])(entry for p in entry_parts for entry in p[j]) for j in range(len(entries))])

    def join(value: torch.Tensor | ValueSequence) -> Any:
        if isinstance(value, torch.Tensor):
            return value if value.ndim == 0 else next(joined)
        return next(joined_entries)

    return apply_to_collection(rows, (torch.Tensor, *EXAMPLE_SEQUENCES), join)


def _augmented(fn: Callable[[Any], Any], piece: Any, multiplicity: int) -> Any:
    """``fn(piece)``, each 0-dim tensor of the piece its own clone (so that no example's ``fn`` writes into what
    another's reads), refused unless it is the piece augmented (:func:`_skeleton`, taken before ``fn`` runs).

    Raises:
        ValueError: ``fn`` returned something else than the copies it was given.
    """
    piece = apply_to_collection(piece, torch.Tensor, lambda tensor: tensor.clone() if tensor.ndim == 0 else tensor)
    given = _skeleton(piece)  # before fn, which may change the piece in place
    result = fn(piece)
    if _skeleton(result) != given:
        raise ValueError(
            "augment_each_example: fn must return the copies it was given, augmented: the same keys and containers, "
            "the same 0-dim tensors and other values (the same objects, unchanged), every tensor of "
            f"K={multiplicity} rows (0 for an empty draw's) and every per-example list of K entries of the same types; "
            f"given {given}, it returned {_skeleton(result)}"
        )
    return result


def _skeleton(value: Any) -> Any:
    """What ``fn`` must keep of one example's copies: the keys and containers (mappings of any class alike), each row
    tensor's rows (``K``), each marked sequence's entries' types, and the other values (0-dim tensors by identity and
    version, other objects by identity, numbers and strings by value)."""
    if isinstance(value, torch.Tensor):
        return ("rows", value.shape[0]) if value.ndim else ("scalar", id(value), value._version)
    if isinstance(value, EXAMPLE_SEQUENCES):
        return ("entries", type(value).__name__, tuple(type(entry).__name__ for entry in value))
    if isinstance(value, Mapping):
        return ("mapping", tuple((key, _skeleton(item)) for key, item in value.items()))
    if is_dataclass_instance(value):
        fields = dataclasses.fields(value)
        return (type(value).__name__, tuple((field.name, _skeleton(getattr(value, field.name))) for field in fields))
    if isinstance(value, (list, tuple)):
        return ("sequence", tuple(_skeleton(item) for item in value))
    return ("value", value if isinstance(value, (str, bytes, int, float, bool, type(None))) else id(value))


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
