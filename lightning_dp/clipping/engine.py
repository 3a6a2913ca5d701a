"""Clipping engines: how the per-sample norm contribution of one parameter is computed from its terms.

An engine maps the terms of one parameter (one per use of it in the forward pass) to ``sum_j |grad_ij|^p``, a
``[B]`` tensor, for the clipping norm ``p`` (2 or 1). The clipper sums these over parameters and takes the ``p``-th
root. Engines register themselves by name in :data:`ENGINES`; a new engine is one new file.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from lightning_dp.clipping.terms import Term, materialise_sum


class ClippingEngine(ABC):
    """Computes per-sample norm contributions of one parameter.

    Attributes:
        name: registry name (the ``clipping=`` argument of the clipper).
        supports_l1: whether ``norm=1`` is available (it needs the per-sample gradients themselves).
    """

    name: str
    supports_l1: bool

    @abstractmethod
    def contribution(self, terms: list[Term], norm: int) -> torch.Tensor:
        """``sum_j |g_ij|^norm`` for ``g_i`` the per-sample gradient summed over all ``terms`` (uses): ``[B]``.

        Args:
            terms: one term per use of the parameter (at least one), all with the same batch size ``B``.
            norm: 2 (squared l2 norm) or 1 (l1 norm; only when ``supports_l1``).
        """


def materialised_contribution(terms: list[Term], norm: int) -> torch.Tensor:
    """Exact contribution from the materialised per-sample gradient (memory ``B * param.numel()``)."""
    grad = materialise_sum(terms).flatten(1)
    return grad.abs().sum(1) if norm == 1 else grad.square().sum(1)


ENGINES: dict[str, ClippingEngine] = {}


def register_engine(engine: ClippingEngine) -> ClippingEngine:
    """Add ``engine`` to :data:`ENGINES` under ``engine.name``."""
    ENGINES[engine.name] = engine
    return engine
