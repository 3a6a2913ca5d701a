"""What underflow can take from a parameter's per-sample squared l2 norm: the bound ``a_i^2`` its rounding scale
carries (docs/design.md section 4.10), a function of the example's own rows whichever path the engine took.

A row that is 0 in one factor and finite in the other (padding: its output gradient is 0, whatever its finite
activation) adds exact zeros to every product and sum the norm is formed from, so it loses nothing and is not counted
(:attr:`~lightning_dp.clipping.terms.Factored.active`): the bound of an example does not move with the length its
batch is padded to. And it is the larger of the Gram-product path's bound and the materialised path's, so that it does
not move with the path an engine chooses by the padded length either (``mixed``, ``fgc``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lightning_dp.clipping.terms import Factored, Materialised, Term, all_factored


def row_squares(term: Factored) -> tuple[torch.Tensor, torch.Tensor]:
    """The squared row norms ``(||l_it||^2, ||r_it||^2)``, ``[B, T]`` each: as an engine noted them
    (:meth:`Factored.note_factor_squares`), else the squares of the term's l2 :meth:`~Factored.row_norms` (1 for a
    one-hot row)."""
    if term.noted:
        return term.factor_squares
    left, right = term.row_norms(2)
    return left if term.is_index else left.square(), right.square()


def underflow_bound(terms: Sequence[Term]) -> torch.Tensor:
    """``[B]``: ``a_i^2``, a bound on what underflow can take from the squared l2 norm of a parameter's per-sample
    gradient (summed over its uses ``terms``) as an engine computes it (docs/design.md section 4.10). With ``tau`` the
    dtype's smallest normal number and ``N`` the parameter's entries:

    - factored uses (:class:`Factored`), ``P x Q`` the parameter: the larger of ``4 tau T (P sum_u ||R_ui||_F^2 + Q
      sum_u ||L_ui||_F^2 + T)``, what a Gram-product norm can lose, and ``4 tau N``, what a materialised one can lose,
      whichever the engine formed; ``T`` counts the rows of all uses that count
      (:attr:`Factored.active`) and the norms are over those rows. A Gram entry's dot product loses at most ``2 P tau``
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
        squares, active = row_squares(term), term.active
        rows = rows + active.sum(1)
        shares = shares + torch.where(active, squares[0] * left_share + squares[1] * right_share, 0).sum(1)
    return (rows * (shares + tau4 * rows)).clamp_min(materialised)
