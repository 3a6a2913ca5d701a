"""Engine ``ghost``: per-sample squared norms from Gram matrices, without per-sample gradients.

``||grad_i||_F^2 = <L_i L_i^T, R_i R_i^T>`` (Li et al. 2022, "Large language models can be strong differentially
private learners", Section 4), memory ``B T^2``; a parameter with several uses includes the cross terms
``sum_{u,v} <L_ui L_vi^T, R_ui R_vi^T>`` (docs/design.md section 4.5). Materialised terms get exact norms. l2 only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_dp.clipping.engines.base import ClippingEngine, materialised_contribution, register_engine
from lightning_dp.clipping.rows import active_products, active_rows
from lightning_dp.clipping.terms import Factored, Term, all_factored


def left_gram(u: Factored, v: Factored) -> torch.Tensor:
    """``L_u L_v^T`` per sample: ``[B, T_u, T_v]`` (one-hot ids handled by equality or gather)."""
    if u.is_index and v.is_index:
        return (u.left.unsqueeze(2) == v.left.unsqueeze(1)).to(u.right.dtype)
    if u.is_index:
        index = u.left.unsqueeze(1).expand(-1, v.left.shape[1], -1)  # [B, T_v, T_u]
        return v.left.gather(2, index).transpose(1, 2)
    if v.is_index:
        return left_gram(v, u).transpose(1, 2)
    return torch.bmm(u.left, v.left.transpose(1, 2))


#: Uses of one kind are concatenated up to this many rows (or the longest use, if longer) before the Gram blocks.
MERGE_ROWS = 256


def merge_uses(terms: Sequence[Factored]) -> list[list[Factored]]:
    """Consecutive uses of the same kind (dense or ids), grouped up to ``max(MERGE_ROWS, longest use)`` rows each; a
    group's uses are concatenated along the sequence (:func:`concatenated`)."""
    limit = max(MERGE_ROWS, max(term.right.shape[1] for term in terms))
    merged: list[list[Factored]] = []
    for term in terms:
        last = merged[-1] if merged else None
        if (
            last is not None
            and last[0].is_index == term.is_index
            and sum(t.right.shape[1] for t in last) + term.right.shape[1] <= limit
        ):
            last.append(term)
        else:
            merged.append([term])
    return merged


def concatenated(group: Sequence[Factored]) -> Factored:
    """One use standing for ``group`` (exact: ``sum_u L_u^T R_u = cat_u(L_u)^T cat_u(R_u)``)."""
    if len(group) == 1:
        return group[0]
    return Factored(torch.cat([t.left for t in group], 1), torch.cat([t.right for t in group], 1), group[0].shape)


#: A dense use of at least this many rows gets its Gram product from two panels (:func:`self_product`).
PANEL_ROWS = 128


def _diagonals(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``[2, B, n]``: the diagonals of the square Gram blocks ``left`` and ``right`` ``[B, n, n]``, copied (the blocks
    can be freed)."""
    return torch.stack([left.diagonal(dim1=1, dim2=2), right.diagonal(dim1=1, dim2=2)])


def _active(u: Factored, rows: slice, diagonals: torch.Tensor) -> torch.Tensor:
    """``[B, n]`` bool: the ``rows`` of ``u`` that count (:func:`~lightning_dp.clipping.rows.active_rows`), given the
    diagonals ``[2, B, n]`` of their Gram blocks."""
    left = None if u.is_index else u.left[:, rows]
    return active_rows(left, u.right[:, rows], diagonals[0], diagonals[1])


def self_product(u: Factored) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``<L L^T, R R^T>`` per sample for one use, ``[B]``, over the rows that count; the diagonals of ``L L^T`` and
    ``R R^T``, ``[2, B, T]`` (the factors' squared row norms, for the rounding scales); and the rows that count,
    ``[B, T]`` bool (:func:`~lightning_dp.clipping.rows.active_rows`). For a dense use of ``T >= PANEL_ROWS`` rows
    each symmetric Gram matrix is formed as two blocks, its lower-right block ``[B, T - h, T - h]`` and its first
    ``h = T // 2`` columns ``[B, T, h]``, and the block below the diagonal, which the panel holds once, is counted
    twice: 3/4 of the multiply-adds (docs/design.md section 12.6). At most one pair of Gram blocks is held at a time,
    multiplied in place."""
    rows = u.right.shape[1]
    if u.is_index or rows < PANEL_ROWS:
        left, right = left_gram(u, u), torch.bmm(u.right, u.right.transpose(1, 2))
        diagonals = _diagonals(left, right)
        active = _active(u, slice(None), diagonals)
        return active_products(left.mul_(right), active, active).sum((1, 2)), diagonals, active
    h = rows // 2
    low_left, low_right = u.left[:, h:], u.right[:, h:]  # first: its diagonal holds the active rows from h on
    left, right = torch.bmm(low_left, low_left.transpose(1, 2)), torch.bmm(low_right, low_right.transpose(1, 2))
    low = _diagonals(left, right)
    low_active = _active(u, slice(h, None), low)
    low_product = active_products(left.mul_(right), low_active, low_active).sum((1, 2))
    del left, right
    left, right = torch.bmm(u.left, u.left[:, :h].transpose(1, 2)), torch.bmm(u.right, u.right[:, :h].transpose(1, 2))
    top = _diagonals(left[:, :h], right[:, :h])
    active = torch.cat([_active(u, slice(None, h), top), low_active], 1)
    panel = active_products(left.mul_(right), active, active[:, :h])
    del left, right
    product = panel.sum((1, 2)) + panel[:, h:].sum((1, 2))
    return product + low_product, torch.cat([top, low], 2), active


def gram_squared_norm(terms: Sequence[Factored]) -> torch.Tensor:
    """``||sum_u L_u^T R_u||_F^2`` per sample via ``sum_{u,v} <L_u L_v^T, R_u R_v^T>``: ``[B]`` (over the groups of
    :func:`merge_uses`), over the rows that count (:func:`~lightning_dp.clipping.rows.active_products`). Each use gets
    its factors' squared norms from the Gram diagonals, and the rows that count
    (:meth:`~lightning_dp.clipping.terms.Factored.note_factor_squares`)."""
    groups = merge_uses(terms)
    uses = [concatenated(group) for group in groups]
    products, actives = [], []
    for group, u in zip(groups, uses, strict=True):
        product, diagonals, active = self_product(u)
        products.append(product)
        actives.append(active)
        start = 0
        for term in group:
            rows = slice(start, start + term.right.shape[1])
            term.note_factor_squares(diagonals[0, :, rows], diagonals[1, :, rows], active[:, rows])
            start = rows.stop
    total = uses[0].right.new_zeros(uses[0].right.shape[0])
    for i, u in enumerate(uses):
        total = total + products[i]
        for j in range(i + 1, len(uses)):
            cross = left_gram(u, uses[j]) * torch.bmm(u.right, uses[j].right.transpose(1, 2))
            total = total + 2.0 * active_products(cross, actives[i], actives[j]).sum((1, 2))
    return total


@register_engine
class GhostEngine(ClippingEngine):
    """Ghost norms; see the module docstring."""

    name = "ghost"
    supports_l1 = False

    def contribution(self, terms: list[Term], norm: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Per-sample squared l2 norm of the parameter's gradient summed over its uses: ``[B]``."""
        if all_factored(terms):
            return gram_squared_norm(terms)
        return materialised_contribution(terms, norm)
