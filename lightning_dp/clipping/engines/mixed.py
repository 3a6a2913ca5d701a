"""Engine ``mixed``: per parameter, ghost norms or materialised per-sample gradients, whichever costs less (the
layerwise choice of Bu et al. 2023, "Differentially private optimization on large model at small cost", Section 3.2,
and Bu et al. 2022, "Scalable and efficient training of large convolutional neural networks with differential
privacy", mixed ghost clipping).

For a parameter of shape ``P x Q`` with factored uses ``u`` of sequence lengths ``T_u``, per sample:

- ghost costs ``sum_{u <= v} T_u T_v (P_uv + Q)`` multiply-adds (the Gram matrices of every pair of uses, cross
  terms of tied weights included), with ``P_uv = 1`` when a use is an embedding (id equality or a gather replaces the
  ``P``-wide product) and ``P_uv = P`` otherwise;
- materialising costs ``P Q + sum_u T_u P Q`` for dense uses (``T_u Q`` for an embedding's scatter).

``mixed`` takes the cheaper. Bu et al. state the rule by memory, ``2 T^2 < P Q``; we decide by the work because the
engines exist for speed and the two rules part exactly where it matters: a 50257-wide output head at ``T = 512`` has
``2 T^2 = 5e5 << P Q = 1.3e7`` (ghost by the memory rule) but a ghost cost ``T^2 (P + Q)`` twice the ``T P Q`` of
materialising. Memory is then bounded by materialising in chunks of samples: ``max(1, floor(2 B T^2 / (P Q)))``
samples at a time, so a chunk's per-sample gradients take at most ghost's memory plus one sample's gradient (the
sum over uses and the squares hold two or three such buffers at once). The decision depends only on
the shapes. Parameters with a materialised term (biases, norms, grouped convolutions) are materialised. Exact; l2.

Under book-keeping a materialised per-sample gradient that holds no more elements than its factors (``P Q <=
sum_u T_u (P + Q)``, which the work rule implies up to a factor of about two) is formed whole and kept for the
clipped sum, ``sum_i c_i g_i``, in place of the factors: the clipped sum then costs ``B P Q`` instead of the
``B T P Q`` of ``sum_i c_i L_i^T R_i``. The factors are freed when every parameter of their group is kept so
(:meth:`~lightning_dp.clipping.engines.base.ClippingEngine.contribution_and_gradient`); forming the whole gradient and
its squares takes up to twice its size for a moment. For a 50257-wide output head at ``T = 512`` this removes a quarter
of the step's work at the same peak memory (docs/performance.md).
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
        for v in terms[i:]:  # each pair once, as gram_squared_norm computes it
            width = 1 if u.is_index or v.is_index else terms[0].shape[0]
            cost += u.right.shape[1] * v.right.shape[1] * (width + cols)
    return cost


def materialise_cost(terms: list[Factored]) -> int:
    """Multiply-adds per sample of forming the summed per-sample gradient (see the module docstring)."""
    rows, cols = terms[0].shape[0], math.prod(terms[0].shape[1:])
    return rows * cols + sum(t.right.shape[1] * (cols if t.is_index else rows * cols) for t in terms)


def chunked_squared_norm(terms: list[Factored]) -> torch.Tensor:
    """Squared norms ``[B]`` of the materialised per-sample gradients, formed a chunk of samples at a time.

    The chunk holds ``max(1, floor(2 B T^2 / (P Q)))`` samples (``T`` the longest use), so one chunk's gradients
    fit in the ghost engine's ``2 B T^2`` plus one sample's ``P Q`` (two or three such buffers live at once).
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
        """Where materialising is chosen and the per-sample gradient is no larger than the factors, it is formed
        whole (not in chunks) and returned for book-keeping's clipped sum; otherwise as :meth:`contribution`."""
        factored = [term for term in terms if isinstance(term, Factored)]
        if len(factored) < len(terms):
            return materialised_contribution_and_gradient(terms, norm)
        if ghost_cost(factored) >= materialise_cost(factored) and gradient_fits(factored):
            return materialised_contribution_and_gradient(factored, norm)
        return self.contribution(terms, norm, generator), None
