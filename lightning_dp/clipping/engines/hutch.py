"""Engine ``hutch``: per-sample squared norms by Hutchinson's trace estimator (seed "Efficient DP-SGD for LLMs with
Randomized Clipping", Algorithm 2 lines 3-6; Hutchinson 1989).

For a linear-like parameter with per-sample gradient ``M_i`` (``m x n``, ``n`` the larger side) the estimate is
``||M_i P||_F^2`` with ``P`` an ``n x k`` matrix of i.i.d. ``N(0, 1/k)`` entries, drawn fresh for every parameter and
step from the DP randomness (never the global RNG; one ``P`` per parameter shared by the batch, so every sample's
estimate has the same law). It is unbiased, ``E ||M P||_F^2 = ||M||_F^2``, with relative variance at most ``2/k``.
Memory ``B (T + m) k + n k`` per parameter, against ``B T^2`` for ghost norms.

Parameters with materialised terms (biases, norm layers, grouped convolutions: "other" layers) get exact norms
(Algorithm 2, line 15). The accountant (``accountant="rc"``, :mod:`lightning_dp.accounting.rc`) bounds the ratio of
estimated to true squared norm from below by ``min(chi^2(k)/k, 1)``, which holds for any mix of exact and
estimated layers and any ``d`` (docs/accountants.md, section on the rc accountant).
"""

from __future__ import annotations

import math
from abc import abstractmethod

import torch

from lightning_dp.clipping.engines.base import ClippingEngine, materialised_contribution, register_engine
from lightning_dp.clipping.engines.projection import GradientOperator
from lightning_dp.clipping.terms import Term, all_factored


def norm_dim(params: list[torch.nn.Parameter]) -> int:
    """``d`` recorded in the randomized-clipping event: an upper bound on the rank of every estimated per-sample
    gradient, ``max_p min(P, Q)`` for a parameter of shape ``P x Q...`` (1 for vectors).

    The seed's ``d = max_l min(p_l, d_l)`` (Theorem 5.1, proof sketch); taking it from the shapes alone is
    conservative, since the seed's envelope is a supremum over the simplex of dimension ``d`` and grows with ``d``.
    (The ``rc`` accountant's bound does not depend on ``d``; the event records it so the ledger is complete.)
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
