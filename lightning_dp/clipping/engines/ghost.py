"""Engine ``ghost``: per-sample squared norms from Gram matrices, without per-sample gradients.

``||grad_i||_F^2 = <L_i L_i^T, R_i R_i^T>`` (Li et al. 2022, "Large language models can be strong differentially
private learners", Section 4), memory ``B T^2``; a parameter with several uses includes the cross terms
``sum_{u,v} <L_ui L_vi^T, R_ui R_vi^T>`` (docs/design.md section 4.5). Materialised terms get exact norms. l2 only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_dp.clipping.engines.base import ClippingEngine, materialised_contribution, register_engine
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


def merge_uses(terms: Sequence[Factored]) -> list[Factored]:
    """Concatenate consecutive uses of the same kind (dense or ids) along the sequence, up to ``max(MERGE_ROWS, longest
    use)`` rows each (exact: ``sum_u L_u^T R_u = cat_u(L_u)^T cat_u(R_u)``).
    """
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
    return [
        group[0]
        if len(group) == 1
        else Factored(torch.cat([t.left for t in group], 1), torch.cat([t.right for t in group], 1), group[0].shape)
        for group in merged
    ]


#: A dense use of at least this many rows gets its Gram product from two panels (:func:`self_product`).
PANEL_ROWS = 128


def self_product(u: Factored) -> torch.Tensor:
    """``<L L^T, R R^T>`` per sample for one use: ``[B]``. For a dense use of ``T >= PANEL_ROWS`` rows each symmetric
    Gram matrix is formed as two panels, its first ``h = T // 2`` columns ``[B, T, h]`` and its lower-right block
    ``[B, T - h, T - h]``, and the block below the diagonal, which the first panel holds once, is counted twice:
    3/4 of the multiply-adds (docs/design.md section 12.6)."""
    rows = u.right.shape[1]
    if u.is_index or rows < PANEL_ROWS:
        return (left_gram(u, u) * torch.bmm(u.right, u.right.transpose(1, 2))).sum((1, 2))
    h = rows // 2
    panel = torch.bmm(u.left, u.left[:, :h].transpose(1, 2)) * torch.bmm(u.right, u.right[:, :h].transpose(1, 2))
    low_left, low_right = u.left[:, h:], u.right[:, h:]
    corner = torch.bmm(low_left, low_left.transpose(1, 2)) * torch.bmm(low_right, low_right.transpose(1, 2))
    return panel.sum((1, 2)) + panel[:, h:].sum((1, 2)) + corner.sum((1, 2))


def gram_squared_norm(terms: Sequence[Factored]) -> torch.Tensor:
    """``||sum_u L_u^T R_u||_F^2`` per sample via ``sum_{u,v} <L_u L_v^T, R_u R_v^T>``: ``[B]`` (after
    :func:`merge_uses`)."""
    terms = merge_uses(terms)
    total = terms[0].right.new_zeros(terms[0].right.shape[0])
    for i, u in enumerate(terms):
        total = total + self_product(u)
        for v in terms[i + 1 :]:
            cross = (left_gram(u, v) * torch.bmm(u.right, v.right.transpose(1, 2))).sum((1, 2))
            total = total + 2.0 * cross
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
