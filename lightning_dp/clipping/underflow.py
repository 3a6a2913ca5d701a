"""What underflow can take from a parameter's per-sample squared l2 norm: the bound ``a_i^2`` its rounding scale
carries (docs/design.md section 4.10), a function of the example's own rows whichever path the engine took.

A row that is 0 in either factor (padding: its output gradient is 0, whatever its activation) adds exact zeros to
every product and sum the norm is formed from, so it loses nothing and is not counted: the bound of an example does not
move with the length its batch is padded to. And it is the larger of the Gram-product path's bound and the
materialised path's, so that it does not move with the path an engine chooses by the padded length either (``mixed``,
``fgc``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lightning_dp.clipping.terms import Factored, Materialised, Term, all_factored


def nonzero_rows(x: torch.Tensor, squares: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` bool: the rows of ``x`` ``[B, T, n]`` with an entry that is not 0 (a NaN counts), given their squared
    norms ``squares`` ``[B, T]`` as computed. A square can underflow to 0 for a row that is not 0, so the entries of the
    rows whose square is 0 are read again (:func:`nonzero_entries`): on the CPU only those rows, gathered; elsewhere
    the whole factor in one pass, since gathering would size its output on the host (a synchronisation)."""
    nonzero = squares != 0
    if x.device.type != "cpu":
        return nonzero | nonzero_entries(x, fused=True)
    zero = ~nonzero
    nonzero[zero] = nonzero_entries(x[zero])
    return nonzero


def nonzero_entries(x: torch.Tensor, fused: bool = False) -> torch.Tensor:
    """``[*x.shape[:-1]]`` bool: whether each row of ``x`` has an entry that is not 0 (a NaN counts), from its largest
    and smallest entries: with ``fused``, one ``torch.aminmax`` pass (on a GPU), else two reductions (faster on the
    CPU)."""
    low, high = torch.aminmax(x, dim=-1) if fused else (x.amin(-1), x.amax(-1))
    return low.ne(0) | high.ne(0)


def row_squares(term: Factored) -> tuple[torch.Tensor, torch.Tensor]:
    """The squared row norms ``(||l_it||^2, ||r_it||^2)``, ``[B, T]`` each: as an engine noted them
    (:meth:`Factored.note_factor_squares`), else computed (1 for a one-hot row)."""
    if term.noted:
        return term.factor_squares
    right = torch.linalg.vector_norm(term.right, 2, dim=-1).square()
    if term.is_index:
        return torch.ones_like(right), right
    return torch.linalg.vector_norm(term.left, 2, dim=-1).square(), right


def active_rows(term: Factored, squares: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``[B, T]`` bool: the rows of ``term`` that are not 0 in either factor (a one-hot row never is), given their
    squared norms (:func:`row_squares`)."""
    active = nonzero_rows(term.right, squares[1])
    return active if term.is_index else active & nonzero_rows(term.left, squares[0])


def underflow_bound(terms: Sequence[Term]) -> torch.Tensor:
    """``[B]``: ``a_i^2``, a bound on what underflow can take from the squared l2 norm of a parameter's per-sample
    gradient (summed over its uses ``terms``) as an engine computes it (docs/design.md section 4.10). With ``tau`` the
    dtype's smallest normal number and ``N`` the parameter's entries:

    - factored uses (:class:`Factored`), ``P x Q`` the parameter: the larger of ``4 tau T (P sum_u ||R_ui||_F^2 + Q
      sum_u ||L_ui||_F^2 + T)``, what a Gram-product norm can lose, and ``4 tau N``, what a materialised one can lose,
      whichever the engine formed; ``T`` counts the rows of all uses that are not 0 in either factor
      (:func:`active_rows`) and the norms are over those rows. A Gram entry's dot product loses at most ``2 P tau``
      (``2 Q tau``), flushed to zero or not, and ``sum_{t,s} |r_t . r_s| <= T ||R||_F^2``; the rest covers the
      products of the entries and their sums;
    - otherwise (the squares of the ``N`` materialised entries): ``4 tau N``.
    """
    first = terms[0]
    tiny = torch.finfo(first.dtype).tiny
    batch, entries = (
        (first.grad.shape[0], first.grad[0].numel())
        if isinstance(first, Materialised)
        else (first.right.shape[0], math.prod(first.shape))
    )
    materialised = 4 * tiny * entries
    if not all_factored(terms):
        return torch.full((batch,), materialised, dtype=first.dtype, device=first.device)
    # each row's share scaled before the sums, which would overflow for rows of norm 1e19 and more (float32)
    tau4, shape = 4 * tiny, terms[0].shape
    left_share, right_share = tau4 * math.prod(shape[1:]), tau4 * shape[0]
    rows = shares = torch.zeros(batch, dtype=first.dtype, device=first.device)
    for term in terms:
        squares = row_squares(term)
        active = active_rows(term, squares)
        rows = rows + active.sum(1)
        shares = shares + torch.where(active, squares[0] * left_share + squares[1] * right_share, 0).sum(1)
    return (rows * (shares + tau4 * rows)).clamp_min(materialised)
