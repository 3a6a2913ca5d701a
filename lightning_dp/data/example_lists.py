"""Per-example entries of a batch that are not tensors: a list of strings from ``default_collate``, a tuple from a
collate that unzips its examples. The Poisson loader marks them (:class:`ExampleList`, :class:`ExampleTuple`, a
``list`` and a ``tuple`` still) wherever collating two examples gives two entries where one gave one, so that what
selects a batch's examples (an empty draw's cut, the physical batch cap's parts, the leave-half-out halves, the
augmented copies) selects their entries with their tensors' rows (:func:`select_examples`) instead of passing the whole
sequence to every part: a step reading them would otherwise fail, or read another example's entry, only at the draws
that are cut.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection


class ExampleList(list):
    """A ``list`` holding one entry per example of its batch, in the batch's order (marked by the Poisson loader)."""


class ExampleTuple(tuple):
    """A ``tuple`` holding one entry per example of its batch, in the batch's order (marked by the Poisson loader)."""


#: The marked sequences.
EXAMPLE_SEQUENCES = (ExampleList, ExampleTuple)
#: A list or a tuple (marked or not).
ValueSequence = list[Any] | tuple[Any, ...]


def _is_value_sequence(value: Any) -> bool:
    """A non-empty list or tuple (not a namedtuple) none of whose entries is a tensor or a collection."""
    if not isinstance(value, (list, tuple)) or not value or hasattr(value, "_fields"):
        return False
    return not any(
        isinstance(item, (torch.Tensor, Mapping, list, tuple)) or dataclasses.is_dataclass(item) for item in value
    )


def map_value_sequences(batch: Any, function: Callable[[ValueSequence], Any]) -> Any:
    """``batch`` with ``function`` applied to each of its value sequences (non-empty lists or tuples, not namedtuples,
    of entries that are neither tensors nor collections; a marked one counts as one), in ``apply_to_collection``'s
    order, the structure rebuilt around them."""

    def visit(sequence: ValueSequence) -> Any:
        if isinstance(sequence, EXAMPLE_SEQUENCES) or _is_value_sequence(sequence):
            return function(sequence)
        items = [apply_to_collection(item, (list, tuple), visit) for item in sequence]
        return type(sequence)(*items) if hasattr(sequence, "_fields") else type(sequence)(items)

    return apply_to_collection(batch, (list, tuple), visit)


def value_sequence_lengths(batch: Any) -> list[int]:
    """The lengths of the value sequences of ``batch`` (lists or tuples of entries that are neither tensors nor
    collections), in the order :func:`mark_examples` visits them."""
    lengths: list[int] = []

    def count(sequence: ValueSequence) -> ValueSequence:
        lengths.append(len(sequence))
        return sequence

    map_value_sequences(batch, count)
    return lengths


def per_example_mask(one: Any, two: Any) -> tuple[bool, ...]:
    """Which value sequences hold one entry per example: those of length 1 in ``one`` (a collate of one example) and
    2 in ``two`` (of that example twice). ``()`` when the two batches do not have the same number of them."""
    first, second = value_sequence_lengths(one), value_sequence_lengths(two)
    if len(first) != len(second):
        return ()
    return tuple(a == 1 and b == 2 for a, b in zip(first, second, strict=True))


def mark_examples(batch: Any, mask: tuple[bool, ...]) -> Any:
    """``batch`` with the value sequences that ``mask`` (:func:`per_example_mask`) flags as :class:`ExampleList` or
    :class:`ExampleTuple`; ``batch`` itself when none is flagged or the batch does not have ``len(mask)`` of them."""
    if not any(mask) or len(value_sequence_lengths(batch)) != len(mask):
        return batch
    flags = iter(mask)

    def mark(sequence: ValueSequence) -> Any:
        if not next(flags):
            return sequence
        return ExampleTuple(sequence) if isinstance(sequence, tuple) else ExampleList(sequence)

    return map_value_sequences(batch, mark)


def select_examples(batch: Any, size: int, index: slice | torch.Tensor) -> Any:
    """The examples ``index`` selects from a batch of ``size``: the rows of every tensor whose first dimension is
    ``size`` (``tensor[index]``) and the entries of every marked sequence of ``size`` entries (of the same type); every
    other entry, 0-dim tensors included, as it is.

    Args:
        batch: any nesting of dicts, lists, tuples, namedtuples and dataclasses.
        size: the batch's number of examples.
        index: a ``slice`` or a 1-dim integer tensor of positions (on any device).
    """

    def take(value: torch.Tensor | ValueSequence) -> Any:
        if isinstance(value, torch.Tensor):
            if value.ndim == 0 or value.shape[0] != size:
                return value
            return value[index if isinstance(index, slice) else index.to(value.device)]
        if len(value) != size:
            return value
        positions = range(size)[index] if isinstance(index, slice) else index.tolist()
        return type(value)(value[position] for position in positions)

    return apply_to_collection(batch, (torch.Tensor, *EXAMPLE_SEQUENCES), take)
