"""Matrix products with a parameter's per-sample gradient without forming it: the primitive of randomized norms.

For a parameter with factored terms ``grad_i = sum_u L_ui^T R_ui`` (``P x Q`` per sample, see
:class:`~lightning_dp.clipping.terms.Factored`), :class:`GradientOperator` arranges ``grad_i`` as ``M_i`` (``m x n``)
with the LARGER side ``n = max(P, Q)`` as columns, and applies ``M_i X`` and ``M_i^T Y`` through the factors: memory
``B (T + m) k`` for ``k`` columns, never ``B P Q`` (seed "Efficient DP-SGD for LLMs with Randomized Clipping",
Section 4: project the larger dimension). Token-id factors (embeddings) are applied by gather and scatter. The rows
that do not count (:attr:`~lightning_dp.clipping.terms.Factored.active`) are zeroed in each factor's product with
``X`` or ``Y``, where a padding row's large activations could overflow (``0 * inf``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lightning_dp.clipping.rows import active_only
from lightning_dp.clipping.terms import Factored


def _left_times(term: Factored, x: torch.Tensor) -> torch.Tensor:
    """``L_i x`` per sample, ``[B, T, k]``, for ``x`` of shape ``[P, k]`` (shared) or ``[B, P, k]``."""
    if not term.is_index:
        return torch.matmul(term.left, x)
    if x.ndim == 2:
        return x[term.left]
    return x.gather(1, term.left.unsqueeze(-1).expand(-1, -1, x.shape[-1]))


def _counted(term: Factored, product: torch.Tensor) -> torch.Tensor:
    """``product`` ``[B, T, k]`` of one of ``term``'s factors with a matrix (a new tensor) with the rows that do not
    count set to 0 in place (:func:`~lightning_dp.clipping.rows.active_only`)."""
    return active_only(product, term.active, in_place=True)


def _left_transposed_times(term: Factored, z: torch.Tensor) -> torch.Tensor:
    """``L_i^T z_i`` per sample, ``[B, P, k]``, for ``z`` of shape ``[B, T, k]``."""
    if not term.is_index:
        return torch.bmm(term.left.transpose(1, 2), z)
    out = z.new_zeros(z.shape[0], term.shape[0], z.shape[-1])
    return out.scatter_add_(1, term.left.unsqueeze(-1).expand_as(z), z)


class GradientOperator:
    """``M_i`` and ``M_i^T`` products for the per-sample gradient of one parameter (all its uses summed).

    Args:
        terms: the parameter's factored terms (at least one; all of one parameter, so they share ``shape``).

    Attributes:
        rows: ``m``, the smaller side of the parameter's ``P x Q`` gradient.
        cols: ``n``, the larger side, projected by the randomized engines.
    """

    def __init__(self, terms: Sequence[Factored]) -> None:
        self.terms = terms
        p = terms[0].shape[0]
        q = terms[0].right.shape[-1]
        #: True when ``M_i = grad_i^T`` (the left side ``P`` is the larger one).
        self.left_is_larger = p > q
        self.rows, self.cols = (q, p) if self.left_is_larger else (p, q)

    @property
    def like(self) -> torch.Tensor:
        """A tensor with the operator's dtype and device."""
        return self.terms[0].right

    def times(self, x: torch.Tensor) -> torch.Tensor:
        """``M_i x``: ``[B, m, k]`` for ``x`` of shape ``[n, k]`` (one matrix for all samples) or ``[B, n, k]``."""
        total = self._term_times(self.terms[0], x)
        for term in self.terms[1:]:
            total = total + self._term_times(term, x)
        return total

    def _term_times(self, term: Factored, x: torch.Tensor) -> torch.Tensor:
        """One use's part of :meth:`times`."""
        if self.left_is_larger:  # M = grad^T = R^T L
            return torch.bmm(term.right.transpose(1, 2), _counted(term, _left_times(term, x)))
        return _left_transposed_times(term, _counted(term, torch.matmul(term.right, x)))  # M = grad = L^T R

    def transposed_times(self, y: torch.Tensor) -> torch.Tensor:
        """``M_i^T y_i``: ``[B, n, k]`` for ``y`` of shape ``[B, m, k]``."""
        total = self._term_transposed_times(self.terms[0], y)
        for term in self.terms[1:]:
            total = total + self._term_transposed_times(term, y)
        return total

    def _term_transposed_times(self, term: Factored, y: torch.Tensor) -> torch.Tensor:
        """One use's part of :meth:`transposed_times`."""
        if self.left_is_larger:  # M^T = grad = L^T R
            return _left_transposed_times(term, _counted(term, torch.bmm(term.right, y)))
        return torch.bmm(term.right.transpose(1, 2), _counted(term, _left_times(term, y)))  # M^T = grad^T = R^T L

    def gaussian(self, k: int, generator: torch.Generator) -> torch.Tensor:
        """A fresh ``n x k`` matrix with i.i.d. ``N(0, 1/k)`` entries from ``generator`` (seed Algorithm 2, line 4)."""
        like = self.like
        draw = torch.randn(self.cols, k, generator=generator, device=like.device, dtype=like.dtype)
        return draw.div_(k**0.5)
