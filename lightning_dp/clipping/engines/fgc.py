"""Engine ``fgc``: fast per-example gradient clipping (Lee & Kifer 2021, "Scaling up differentially private deep
learning with fast per-example gradient clipping", PETS 2021).

One parameter (one layer) at a time: its per-sample gradients are materialised, reduced to squared norms and freed
before the next parameter, so peak extra memory is ``B * numel`` of the largest parameter. For a linear map applied
once per sample (``T = 1``) the per-sample gradient is the outer product ``g_i a_i^T`` and its squared norm is
``||g_i||^2 ||a_i||^2`` (Lee & Kifer, Section 4), computed without forming it (the ``1 x 1`` Gram case of
:func:`~lightning_dp.clipping.engines.ghost.gram_squared_norm`). Exact; l2 only.
"""

from __future__ import annotations

import torch

from lightning_dp.clipping.engines.base import ClippingEngine, materialised_contribution, register_engine
from lightning_dp.clipping.engines.ghost import gram_squared_norm
from lightning_dp.clipping.terms import Term, all_factored


@register_engine
class FgcEngine(ClippingEngine):
    """Layer-at-a-time materialisation with the rank-one identity at ``T = 1``; see the module docstring."""

    name = "fgc"

    def contribution(self, terms: list[Term], norm: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """Per-sample squared l2 norm of the parameter's gradient summed over its uses: ``[B]``."""
        if all_factored(terms) and all(term.right.shape[1] == 1 for term in terms):
            return gram_squared_norm(terms)
        return materialised_contribution(terms, norm)
