"""The physical batch cap (``max_physical_batch_size``, Opacus's name) on the data side: its validation, cutting one
training batch into parts of at most ``cap`` examples, as equal as they can be (:func:`split_rows`), and the expected
number of parts per logical step (:func:`expected_physical_batches`, for the start-up block). The passes themselves:
:mod:`lightning_dp.engine.physical_batches`.
"""

from __future__ import annotations

import itertools
import math
import numbers
from typing import Any

import torch
from scipy.stats import binom

from lightning_dp.data.batch_tensors import holds_rows
from lightning_dp.data.example_lists import select_examples


def validate_max_physical_batch_size(cap: object) -> None:
    """Raise ``ValueError`` unless ``cap`` is ``None`` or a whole number ``>= 1``."""
    if cap is None:
        return
    if isinstance(cap, bool) or not isinstance(cap, numbers.Integral) or cap < 1:
        raise ValueError(
            f"max_physical_batch_size must be a whole number >= 1 (examples per forward/backward pass) or None (no "
            f"cap), got {cap!r}"
        )


def part_sizes(size: int, cap: int) -> list[int]:
    """The sizes of the ``ceil(size / cap)`` parts of a batch of ``size`` examples (``[]`` for none): as equal as
    they can be (``torch.tensor_split``'s: the first ``size mod count`` parts one larger). A batch above ``cap`` has no
    part below ``ceil(cap / 2)``, so a pass of one example comes only with a batch of one (``cap >= 3``), not with
    every size one above a multiple of ``cap`` (a sharded model's stand-in batches aside)."""
    if size == 0:
        return []
    count = -(-size // cap)
    base, larger = divmod(size, count)
    return [base + 1] * larger + [base] * (count - larger)


def split_rows(batch: Any, size: int, cap: int) -> list[Any]:
    """``batch`` cut into parts of at most ``cap`` examples, of the sizes :func:`part_sizes` gives (``[]`` for an
    empty batch).

    Every tensor whose first dimension is ``size`` is sliced along it (views, in order), and every per-example sequence
    the Poisson loader marked (:mod:`lightning_dp.data.example_lists`) with it; other entries are repeated in each part.
    A batch of at most ``cap`` examples is returned as it is.

    Raises:
        ValueError: no tensor of ``batch`` has ``size`` rows and no marked sequence ``size`` entries (checked whatever
            ``size``, so that whether it raises does not depend on the draw).
    """
    if not holds_rows(batch, size):
        raise ValueError(
            f"max_physical_batch_size={cap} cannot split a training batch of {size} examples: none of its tensors has "
            "the examples along its first dimension, nor any of its lists one entry per example; return such tensors "
            "from the training loader"
        )
    if size <= cap:
        return [batch] if size else []
    sizes = part_sizes(size, cap)
    ends = list(itertools.accumulate(sizes))
    return [select_examples(batch, size, slice(end - length, end)) for end, length in zip(ends, sizes, strict=True)]


def expected_physical_batches(
    *, shard_size: int, sample_rate: float, micro_batches: int, cap: int, batch_size: int | None = None
) -> float:
    """The expected forward/backward passes of one process per logical step under the cap: ``E[sum_j max(1, ceil(S_j
    / cap))]`` over the ``micro_batches`` parts ``S_j`` (``torch.tensor_split`` sizes) of a Poisson batch ``X ~
    Binomial(shard_size, q)``; with ``batch_size`` (fixed batches, ``poisson_sampling=False``) ``micro_batches *
    ceil(batch_size / cap)``. Computed from the options and N only (no data)."""
    if batch_size is not None:
        return float(micro_batches * max(1, math.ceil(batch_size / cap)))
    # the sizes between the 1e-30 and 1 - 1e-16 quantiles: all the mass up to rounding, however large the shard
    low, high = binom.ppf([1e-30, 1 - 1e-16], shard_size, sample_rate)
    sizes = torch.arange(int(low), int(high) + 1, dtype=torch.int64)
    probabilities = torch.from_numpy(binom.pmf(sizes.numpy(), shard_size, sample_rate))
    probabilities /= probabilities.sum()
    whole, larger = sizes // micro_batches, sizes % micro_batches  # `larger` parts of whole + 1, the rest of whole
    passes = larger * ((whole + cap) // cap).clamp(min=1) + (micro_batches - larger) * ((whole + cap - 1) // cap).clamp(
        min=1
    )
    return float((probabilities * passes.to(torch.float64)).sum())
