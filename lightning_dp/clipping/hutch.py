"""Engine ``hutch``: per-sample squared norms by Hutchinson's trace estimator (seed "Efficient DP-SGD for LLMs with
Randomized Clipping", Algorithm 2 lines 3-6; Hutchinson 1989).

For a linear-like parameter with per-sample gradient ``M_i`` (``m x n``, ``n`` the larger side) the estimate is
``||M_i P||_F^2`` with ``P`` an ``n x k`` matrix of i.i.d. ``N(0, 1/k)`` entries, drawn fresh for every parameter and
step from the DP randomness (never the global RNG; one ``P`` per parameter shared by the batch, so every sample's
estimate has the same law). It is unbiased, ``E ||M P||_F^2 = ||M||_F^2``, with relative variance at most ``2/k``.
Memory ``B (T + m) k + n k`` per parameter, against ``B T^2`` for ghost norms.

Parameters with materialised terms (biases, norm layers, grouped convolutions) are projected too, as ``1 x n``
matrices, where Algorithm 2 (line 15) takes their exact norms. Reason: the seed's privacy proof (Theorem 5.1, proof
sketch) views the independent per-layer projections as ONE stacked projection of all layers, padded to the widest
non-projected side ``d``; an exact part is outside that view, and it breaks the bound: with ``d = 1`` the estimate
of ``c + ||g||^2`` with a deterministic ``c > 0`` is more concentrated than ``chi^2(k)/k``, so its CDF exceeds the
envelope just above 1. Projected, every parameter is a block of the stacked matrix, and the accountant's ``d`` is
the largest smaller side over the parameters (see :func:`norm_dim`).

Clipping then uses the estimated norm, so a clipped contribution can exceed ``C``: the privacy of the run is
accounted by the randomized-clipping accountant (Section 5 of the seed), never by the plain Gaussian one.
"""

from __future__ import annotations

import math
from abc import abstractmethod

import torch

from lightning_dp.clipping.engine import ClippingEngine, register_engine
from lightning_dp.clipping.projection import DenseGradientOperator, GradientOperator
from lightning_dp.clipping.terms import Factored, Term


def norm_dim(params: list[torch.nn.Parameter]) -> int:
    """``d`` of the randomized-clipping accountant: an upper bound on the rank of every parameter's per-sample
    gradient as the engines arrange it, ``max_p min(P, Q)`` for a parameter of shape ``P x Q...`` (1 for vectors).

    The seed's ``d = max_l min(p_l, d_l)`` (Theorem 5.1, proof sketch); taking the bound from the shapes alone is
    conservative, since the envelope is a supremum over the simplex of dimension ``d`` and grows with ``d``.
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
        """An unbiased estimate of the per-sample squared l2 norm: ``[B]``.

        Raises:
            ValueError: no ``generator``.
        """
        if generator is None:
            raise ValueError(f"clipping={self.name!r} needs a generator for its random projections")
        if all(isinstance(term, Factored) for term in terms):
            return self.estimate(GradientOperator(terms), generator)
        return self.estimate(DenseGradientOperator(terms), generator)

    @abstractmethod
    def estimate(self, operator: GradientOperator | DenseGradientOperator, generator: torch.Generator) -> torch.Tensor:
        """The estimate of ``||M_i||_F^2`` for every sample: ``[B]``."""


@register_engine
class HutchEngine(RandomizedEngine):
    """Hutchinson's estimator; see the module docstring."""

    name = "hutch"

    def estimate(self, operator: GradientOperator | DenseGradientOperator, generator: torch.Generator) -> torch.Tensor:
        """``||M_i P||_F^2`` (Algorithm 2, lines 4-6): ``[B]``."""
        return operator.times(operator.gaussian(self.projection_dim, generator)).square().sum((1, 2))
