"""Engine ``flat``: materialise each parameter's per-sample gradient, summed over its uses, and take its norm.

Exact for every layer and for tied parameters. Peak extra memory is ``B * numel`` of the largest parameter (each
parameter's per-sample gradient is freed after its norm is taken, unless book-keeping keeps it for the clipped sum
in place of the larger factors it was formed from: :meth:`ClippingEngine.contribution_and_gradient`). The only
engine supporting l1 clipping.
Oracle: ``torch.func.vmap(torch.func.grad(...))`` (docs/design.md section 11).
"""

from __future__ import annotations

import torch

from lightning_dp.clipping.engines.base import (
    ClippingEngine,
    materialised_contribution,
    materialised_contribution_and_gradient,
    register_engine,
)
from lightning_dp.clipping.terms import Term


@register_engine
class FlatEngine(ClippingEngine):
    """Per-sample gradients in full; see the module docstring."""

    name = "flat"
    supports_l1 = True

    def contribution(self, terms: list[Term], norm: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """``sum_j |g_ij|^norm`` from the materialised per-sample gradient ``g_i``: ``[B]``."""
        return materialised_contribution(terms, norm)

    def contribution_and_gradient(
        self, terms: list[Term], norm: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The contribution and, when no larger than the terms, the per-sample gradient it was computed from."""
        return materialised_contribution_and_gradient(terms, norm)
