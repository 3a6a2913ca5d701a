"""Engine ``mixed``: per parameter, ghost norms or materialised per-sample gradients, whichever costs fewer
multiply-adds (Bu et al. 2023, "Differentially private optimization on large model at small cost", Section 3.2; Bu
et al. 2022, "Scalable and efficient training of large convolutional neural networks with differential privacy").

Per sample, for a ``P x Q`` parameter with factored uses of lengths ``T_u``: ghost costs
``sum_{u <= v} T_u T_v (P_uv + Q)`` (``P_uv = 1`` for an embedding use), materialising ``P Q + sum_u T_u P Q``
(``T_u Q`` for an embedding). Materialisation runs in chunks of samples; a gradient no larger than its factors is
kept for book-keeping. Exact; l2. Rationale and measurements: docs/design.md sections 4.3 and 12.6.
"""

from __future__ import annotations

import math

import torch

from lightning_dp.clipping.engines.base import (
    ClippingEngine,
    gradient_fits,
    materialised_contribution,
    materialised_contribution_and_gradient,
    register_engine,
)
from lightning_dp.clipping.engines.ghost import gram_squared_norm
from lightning_dp.clipping.terms import Factored, Term


def ghost_cost(terms: list[Factored]) -> int:
    """Multiply-adds per sample of the Gram-matrix norm over all pairs of uses (see the module docstring)."""
    cols = math.prod(terms[0].shape[1:])
    cost = 0
    for i, u in enumerate(terms):
        for v in terms[i:]:  # each pair once (a long dense use pairs with itself at 3/4 of this: ghost.self_product)
            width = 1 if u.is_index or v.is_index else terms[0].shape[0]
            cost += u.right.shape[1] * v.right.shape[1] * (width + cols)
    return cost


def materialise_cost(terms: list[Factored]) -> int:
    """Multiply-adds per sample of forming the summed per-sample gradient (see the module docstring)."""
    rows, cols = terms[0].shape[0], math.prod(terms[0].shape[1:])
    return rows * cols + sum(t.right.shape[1] * (cols if t.is_index else rows * cols) for t in terms)


def chunked_squared_norm(terms: list[Factored]) -> torch.Tensor:
    """Squared norms ``[B]`` of the materialised per-sample gradients, ``max(1, floor(2 B T^2 / (P Q)))`` samples at a
    time (``T`` the longest use).
    """
    batch = terms[0].right.shape[0]
    longest = max(term.right.shape[1] for term in terms)
    size = math.prod(terms[0].shape)
    chunk = max(1, (2 * batch * longest * longest) // size)
    parts = [
        materialised_contribution([term.samples(slice(start, start + chunk)) for term in terms], 2)
        for start in range(0, batch, chunk)
    ]
    return torch.cat(parts)


@register_engine
class MixedEngine(ClippingEngine):
    """Ghost or chunked materialisation per parameter, whichever costs less; see the module docstring."""

    name = "mixed"

    def contribution(self, terms: list[Term], norm: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Per-sample squared l2 norm of the parameter's gradient summed over its uses: ``[B]``."""
        factored = [term for term in terms if isinstance(term, Factored)]
        if len(factored) < len(terms):
            return materialised_contribution(terms, norm)
        if ghost_cost(factored) < materialise_cost(factored):
            return gram_squared_norm(factored)
        return chunked_squared_norm(factored)

    def contribution_and_gradient(
        self, terms: list[Term], norm: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where materialising is chosen and the gradient is no larger than the factors, it is formed whole and returned
        for book-keeping; otherwise as :meth:`contribution`.
        """
        factored = [term for term in terms if isinstance(term, Factored)]
        if len(factored) < len(terms):
            return materialised_contribution_and_gradient(terms, norm)
        if ghost_cost(factored) >= materialise_cost(factored) and gradient_fits(factored):
            return materialised_contribution_and_gradient(factored, norm)
        return self.contribution(terms, norm, generator), None
