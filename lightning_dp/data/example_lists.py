"""Per-example entries of a batch that are not a tensor's rows: a tuple of strings from ``default_collate``, a list of
per-example dicts or variable-length tensors from a custom collate. The Poisson loader finds, once, the places
(paths) where collating two examples gives a list or tuple of two entries where one example gave one
(:func:`per_example_paths`), and marks what every batch holds there (:func:`mark_examples`: :class:`ExampleList`,
:class:`ExampleTuple`, a ``list`` and a ``tuple`` still), so that what selects a batch's examples (an empty draw's cut,
the physical batch cap's parts, the leave-half-out halves, the per-user grouping, the augmented copies) selects their
entries with their tensors' rows (:func:`select_examples`) instead of passing the whole sequence to every part.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from lightning_utilities.core.apply_func import apply_to_collection, is_dataclass_instance


class ExampleList(list):
    """A ``list`` holding one entry per example of its batch, in the batch's order (marked by the Poisson loader)."""


class ExampleTuple(tuple):
    """A ``tuple`` holding one entry per example of its batch, in the batch's order (marked by the Poisson loader)."""


#: The marked sequences.
EXAMPLE_SEQUENCES = (ExampleList, ExampleTuple)


def _flatten(sequence: ExampleList | ExampleTuple) -> tuple[list[Any], None]:
    return list(sequence), None


# torch's pytrees (``tree_map``, ``tree_leaves``) walk them as they walk a list or tuple, and keep their type
pytree.register_pytree_node(
    ExampleList,
    _flatten,
    lambda values, _: ExampleList(values),
    serialized_type_name="lightning_dp.data.example_lists.ExampleList",
)
pytree.register_pytree_node(
    ExampleTuple,
    _flatten,
    lambda values, _: ExampleTuple(values),
    serialized_type_name="lightning_dp.data.example_lists.ExampleTuple",
)
#: A list or a tuple (marked or not).
ValueSequence = list[Any] | tuple[Any, ...]
#: Where a value sits in a batch: the keys, indices and dataclass field names leading to it from the batch's root.
Path = tuple[Any, ...]


def _is_sequence(value: Any) -> bool:
    """A list or a tuple that is not a namedtuple."""
    return isinstance(value, (list, tuple)) and not hasattr(value, "_fields")


def _entries(value: Any) -> int | None:
    """The rows of a tensor of one dimension or more, or the length of a list or tuple that is not a namedtuple."""
    if isinstance(value, torch.Tensor):
        return value.shape[0] if value.ndim else None
    return len(value) if _is_sequence(value) else None


def per_example_paths(one: Any, two: Any, path: Path = ()) -> tuple[Path, ...]:
    """The paths where a batch holds one entry per example: of a list, tuple (not a namedtuple) or tensor of 1 entry
    (row) in ``one``, a collate of one example, and 2 in ``two``, a collate of that example twice (entries of any
    kind: strings, dicts, tensors; a collate may stack the examples' tensors or list them, as their shapes allow).
    Walks dicts and other mappings, dataclasses, namedtuples and the sequences of the same length in both; does not
    look inside a per-example sequence. ``()`` when there is none."""
    if _entries(one) == 1 and _entries(two) == 2:
        return (path,)
    if isinstance(one, torch.Tensor) or type(one) is not type(two):
        return ()
    if isinstance(one, Mapping):
        children = [(key, one[key], two[key]) for key in one if key in two]
    elif is_dataclass_instance(one):
        names = [field.name for field in dataclasses.fields(one) if field.init]
        children = [(name, getattr(one, name), getattr(two, name)) for name in names]
    elif isinstance(one, (list, tuple)):
        if len(one) != len(two):
            return ()
        children = [(index, a, b) for index, (a, b) in enumerate(zip(one, two, strict=True))]
    else:
        return ()
    return tuple(found for key, a, b in children for found in per_example_paths(a, b, (*path, key)))


def find_example_paths(collate_fn: Callable[[list[Any]], Any], example: Any) -> tuple[Any, tuple[Path, ...]]:
    """The collate of ``example`` alone, and :func:`per_example_paths` from it and the collate of ``example`` twice;
    each collate gets its own :func:`example_copy` (a collator may change what it is given), all of one fetch (a random
    transform gives each fetch its own shapes)."""
    one = collate_fn([example_copy(example)])
    return one, per_example_paths(one, collate_fn([example_copy(example), example_copy(example)]))


def _child(container: Any, key: Any) -> Any:
    if is_dataclass_instance(container):
        return getattr(container, key)
    return container[key]


def _with_child(container: Any, key: Any, value: Any) -> Any:
    """``container`` with ``value`` at ``key``: mutable mappings, lists and dataclasses in place (so a mapping keeps its
    class and its attributes, e.g. a fast tokenizer's ``BatchEncoding``), tuples and frozen dataclasses rebuilt."""
    if isinstance(container, (MutableMapping, list)):
        container[key] = value
        return container
    if isinstance(container, Mapping):
        return type(container)({**container, key: value})  # type: ignore[call-arg]
    if is_dataclass_instance(container):
        if container.__dataclass_params__.frozen:
            return dataclasses.replace(container, **{key: value})
        setattr(container, key, value)
        return container
    items = list(container)
    items[key] = value
    return type(container)(*items) if hasattr(container, "_fields") else type(container)(items)


def _has_path(batch: Any, path: Path) -> bool:
    value = batch
    for key in path:
        if isinstance(value, Mapping):
            if key not in value:
                return False
        elif is_dataclass_instance(value):
            if not hasattr(value, key):
                return False
        elif not isinstance(value, (list, tuple)) or not isinstance(key, int) or key >= len(value):
            return False
        value = _child(value, key)
    return _is_sequence(value)


def _marked_at(batch: Any, path: Path) -> Any:
    if not path:
        return _mark(batch)
    key = path[0]
    return _with_child(batch, key, _marked_at(_child(batch, key), path[1:]))


def _mark(sequence: ValueSequence) -> ValueSequence:
    if isinstance(sequence, EXAMPLE_SEQUENCES):
        return sequence
    return ExampleTuple(sequence) if isinstance(sequence, tuple) else ExampleList(sequence)


def mark_examples(batch: Any, paths: tuple[Path, ...]) -> Any:
    """``batch`` with the list or tuple at each of ``paths`` (:func:`per_example_paths`) marked as an
    :class:`ExampleList` or :class:`ExampleTuple`, whatever its entries; mutable containers are changed in place. A
    path where ``batch`` holds no list or tuple (a tensor, or nothing) is skipped."""
    for path in paths:
        if _has_path(batch, path):
            batch = _marked_at(batch, path)
    return batch


def _at(batch: Any, path: Path) -> Any:
    for key in path:
        batch = _child(batch, key)
    return batch


def refuse_plain_sequences(batch: Any, paths: tuple[Path, ...]) -> None:
    """Raise where ``batch`` holds an unmarked list or tuple (not a namedtuple) at one of ``paths``
    (:func:`per_example_paths`): one that a hook rebuilt (a list comprehension in Lightning's
    ``on_after_batch_transfer``), or a padded ``(ids, mask)`` it put there, would be passed whole to every part of the
    batch at the draws that are cut, so it is refused at every batch, empty ones included.

    Raises:
        ValueError: naming the path.
    """
    for path in (path for path in paths if _has_path(batch, path)):
        value = _at(batch, path)
        if not isinstance(value, EXAMPLE_SEQUENCES):
            raise ValueError(
                f"the training batch holds a plain {type(value).__name__} at {list(path)}, where the "
                "Poisson loader's batches hold one entry per example in a lightning_dp.data.ExampleList (or "
                "ExampleTuple): a hook rebuilt it, and it would be passed whole to every part of a cut batch; keep "
                "its type (ExampleList(...)), or put a tensor, a dict or a namedtuple of tensors there"
            )


def select_examples(batch: Any, size: int, index: slice | torch.Tensor) -> Any:
    """The examples ``index`` selects from a batch of ``size``.

    Args:
        batch: any nesting of dicts, lists, tuples, namedtuples and dataclasses.
        size: the batch's number of examples.
        index: a ``slice`` or a 1-dim integer tensor of positions (on any device).

    Returns:
        The same structure with the rows ``tensor[index]`` of every tensor whose first dimension is ``size``, and the
        entries at ``index`` of every marked sequence of ``size`` entries (of the same type); every other entry, 0-dim
        tensors included, as it is.
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


def example_sequences(batch: Any) -> list[ValueSequence]:
    """The marked sequences of ``batch``, in ``apply_to_collection``'s order."""
    found: list[ValueSequence] = []
    apply_to_collection(batch, EXAMPLE_SEQUENCES, found.append)
    return found


def example_copy(example: Any) -> Any:
    """A copy of ``example`` for a collate that may change what it is given (pop a key, normalise an array in place):
    dicts and other mappings (their class and attributes kept), lists, tuples, namedtuples and dataclasses (frozen
    ones too) rebuilt, each tensor detached and cloned (a view's own elements, not the storage of a data set it
    indexes), every other value deep-copied. Never raises: what it cannot copy (a lock, a file handle) it keeps."""
    if isinstance(example, torch.Tensor):
        return example.detach().clone()
    if isinstance(example, Mapping):
        items = {key: example_copy(value) for key, value in example.items()}
        try:
            if not isinstance(example, MutableMapping):
                return type(example)(items)  # type: ignore[call-arg]
            clone = copy.copy(example)
            clone.update(items)
            return clone
        except (TypeError, ValueError, copy.Error):
            return items
    if is_dataclass_instance(example):
        clone = copy.copy(example)
        for field in dataclasses.fields(example):
            object.__setattr__(clone, field.name, example_copy(getattr(example, field.name)))
        return clone
    if isinstance(example, (list, tuple)):
        entries = [example_copy(item) for item in example]
        try:
            return type(example)(*entries) if hasattr(example, "_fields") else type(example)(entries)
        except TypeError:
            return example
    try:
        return copy.deepcopy(example)
    except (TypeError, ValueError, RuntimeError, copy.Error):
        return example
