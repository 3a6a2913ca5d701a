"""Which rows of a factored per-sample gradient ``L_i^T R_i`` count (docs/design.md section 4.10).

A row that is 0 in one factor and finite in the other (padding: its output gradient is 0, whatever its finite
activation) adds exact zeros to the gradient, so every quantity formed from the rows (Gram-product norms, rounding
scales, the underflow bound) leaves it out: otherwise a padding row whose activation's square overflows (entries of
about 1e19 and more in float32) turns them into NaN (``0 * inf``), and the example would be dropped exactly when another
example pads its batch. A row that is 0 in one factor and not finite in the other counts, as ``0 * inf`` is NaN in the
per-sample gradient too.
"""

from __future__ import annotations

import torch

#: The integer dtype of each floating-point width, to read a float tensor's bits.
INTEGER_OF_WIDTH = {2: torch.int16, 4: torch.int32, 8: torch.int64}

#: The device types on which a pass that only a few rows need reads or writes those rows alone, picked by a boolean
#: mask or its indices, which size the gather on the host: a synchronisation on a GPU, which passes over the whole
#: tensor instead.
#: bench/op_count.py empties it to count, on the CPU, the operators a GPU step dispatches.
GATHERING_DEVICES: frozenset[str] = frozenset({"cpu"})


def gathers(x: torch.Tensor) -> bool:
    """Whether a pass over some rows of ``x`` gathers them (``x``'s device type is in :data:`GATHERING_DEVICES`)."""
    return x.device.type in GATHERING_DEVICES


def zero_and_finite_rows(x: torch.Tensor, norms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``([B, T], [B, T])`` bool: the rows of ``x`` ``[B, T, n]`` whose entries are all 0 (either sign), and those whose
    entries are all finite, given the rows' norms (or squared norms) ``norms`` ``[B, T]`` as computed. A norm can
    underflow to 0 for a row that is not 0, and overflow for a finite row, so such rows are read again: where
    :func:`gathers` (the CPU) only they, gathered, and 0 by their bits (a subnormal is not 0 under flush-to-zero
    either); elsewhere the whole factor in one pass (:func:`extreme_entries`), since a gather would size its output on
    the host (a synchronisation)."""
    if not gathers(x):
        low, high = extreme_entries(x, fused=True)
        # both finite: both times 0 are zeros, equal (an infinite or NaN one gives NaN, equal to nothing); 3 operators
        # where two isfinite and their AND are 9
        return low.eq(0) & high.eq(0), low.mul(0).eq(high.mul(0))
    maybe_zero, finite = norms == 0, norms.isfinite()
    # by the bits, which flush-to-zero (denormals read as 0 on this thread, not on every other) does not touch
    bits = x[maybe_zero].view(INTEGER_OF_WIDTH[x.element_size()]).bitwise_left_shift(1)  # without the sign bit
    low, high = extreme_entries(bits)
    zero = torch.zeros_like(maybe_zero)
    zero[maybe_zero] = low.eq(0) & high.eq(0)
    unsure = ~finite
    finite[unsure] = x[unsure].isfinite().all(-1)
    return zero, finite


def extreme_entries(x: torch.Tensor, fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, high)``, ``[*x.shape[:-1]]`` each: the smallest and largest entry of each row of ``x`` (NaN where the row
    has one): with ``fused``, one ``torch.aminmax`` pass, else two reductions; by default fused off the CPU (on the CPU
    the two reductions are faster)."""
    if fused is None:
        fused = x.device.type != "cpu"
    if fused:
        low, high = torch.aminmax(x, dim=-1)
        return low, high
    return x.amin(-1), x.amax(-1)


def zero_rows_(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, T, n]`` (contiguous) itself, with the rows where ``rows`` ``[B, T]`` (bool) is True set to +0 in
    place and every other row keeping its bits: where :func:`gathers` (the CPU) a write of those rows alone, by index,
    whose cost grows with their number only; elsewhere a bitwise AND of every entry with all ones or all zeros, one
    read and one write of ``x`` without a host read. Either way, the same bits."""
    if gathers(x):  # by index (a boolean mask would be a masked_fill_, a pass over every entry)
        x.view(-1, x.shape[-1]).index_fill_(0, rows.flatten().nonzero().squeeze(1), 0.0)
        return x
    keep = rows.logical_not().to(INTEGER_OF_WIDTH[x.element_size()]).neg_().unsqueeze(-1)  # -1: all ones
    x.view(keep.dtype).bitwise_and_(keep)
    return x


def active_rows(
    left: torch.Tensor | None, right: torch.Tensor, left_norms: torch.Tensor | None, right_norms: torch.Tensor
) -> torch.Tensor:
    """``[B, T]`` bool: the rows whose products are not all exact zeros, all but those that are 0 in one factor and
    finite in the other (:func:`zero_and_finite_rows`), for ``left`` and ``right`` ``[B, T, n]`` with their row norms
    (or squared norms) ``[B, T]``; ``left`` None for one-hot rows (token ids), finite and never 0."""
    right_zero, right_finite = zero_and_finite_rows(right, right_norms)
    if left is None or left_norms is None:
        return ~right_zero
    left_zero, left_finite = zero_and_finite_rows(left, left_norms)
    return ~((right_zero & left_finite) | (left_zero & right_finite))


def active_products(products: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``products`` ``[B, T, S]`` (entries of Gram products, row ``t`` and column ``s``) with the entries of a row or
    column that does not count (``rows`` ``[B, T]``, ``cols`` ``[B, S]``, :func:`active_rows`) set to 0, in place:
    they are exact zeros, or NaN where the other factor's square overflowed. Two passes, no mask of the products'
    size."""
    return products.masked_fill_((~rows).unsqueeze(2), 0.0).masked_fill_((~cols).unsqueeze(1), 0.0)


def active_only(x: torch.Tensor, active: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``x`` ``[B, T, n]`` (a factor, or its product with a matrix) with the rows that do not count (``active``
    ``[B, T]``, :func:`active_rows`) set to 0, ``in_place`` or in a copy: their products with the other factor's rows
    are exact zeros already, unless scaling or a projection made them overflow (``0 * inf``)."""
    inactive = ~active.unsqueeze(-1)
    return x.masked_fill_(inactive, 0.0) if in_place else x.masked_fill(inactive, 0.0)
