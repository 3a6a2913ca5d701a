"""Engine ``hutch``: per-sample squared norms by Hutchinson's trace estimator (seed "Efficient DP-SGD for LLMs with
Randomized Clipping", Algorithm 2 lines 3-6; Hutchinson 1989).

For a per-sample gradient ``M_i`` (``m x n``, ``n`` the larger side) the estimate is ``||M_i P||_F^2``, ``P`` an
``n x k`` matrix of i.i.d. ``N(0, 1/k)`` entries drawn per parameter and step from the DP randomness (shared by the
batch): unbiased, relative variance at most ``2/k``; memory ``B (T + m) k + n k`` per parameter. Materialised terms
get exact norms (Algorithm 2, line 15). Accounted by ``accountant="rc"`` (:mod:`lightning_dp.accounting.rc`;
docs/design.md section 6.5).
"""

from __future__ import annotations

import math
from abc import abstractmethod

import torch

from lightning_dp.clipping.engines.base import ClippingEngine, materialised_contribution, register_engine
from lightning_dp.clipping.engines.projection import GradientOperator
from lightning_dp.clipping.terms import Term, all_factored


def norm_dim(params: list[torch.nn.Parameter]) -> int:
    """``d`` recorded in the randomized-clipping event: ``max_p min(P, Q)`` over the parameters' shapes (1 for vectors),
    a conservative bound on the seed's ``d`` (Theorem 5.1).
    """
    dims = [min(p.shape[0], math.prod(p.shape[1:])) if p.ndim >= 2 else 1 for p in params]
    return max(dims, default=1)


class RandomizedEngine(ClippingEngine):
    """Shared skeleton of ``hutch``/``hutchpp``: exact for materialised terms, an estimate for factored ones.

    Args:
        projection_dim: ``k``, the number of random projection columns (>= 1).
    """

    randomized = True

    def __init__(self, projection_dim: int) -> None:
        self.projection_dim = int(projection_dim)

    def contribution(self, terms: list[Term], norm: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """An unbiased estimate of the per-sample squared l2 norm (exact when a term is materialised): ``[B]``.

        Raises:
            ValueError: no ``generator``.
        """
        if not all_factored(terms):
            return materialised_contribution(terms, norm)
        if generator is None:
            raise ValueError(f"clipping={self.name!r} needs a generator for its random projections")
        return self.estimate(GradientOperator(terms), generator)

    @abstractmethod
    def estimate(self, operator: GradientOperator, generator: torch.Generator) -> torch.Tensor:
        """The estimate of ``||M_i||_F^2`` for every sample: ``[B]``."""


@register_engine
class HutchEngine(RandomizedEngine):
    """Hutchinson's estimator; see the module docstring."""

    name = "hutch"
    estimator = "hutch"

    def estimate(self, operator: GradientOperator, generator: torch.Generator) -> torch.Tensor:
        """``||M_i P||_F^2`` (Algorithm 2, lines 4-6): ``[B]``."""
        return operator.times(operator.gaussian(self.projection_dim, generator)).square().sum((1, 2))
