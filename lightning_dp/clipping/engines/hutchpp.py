"""Engine ``hutchpp``: per-sample squared norms by Hutch++ (Meyer et al. 2021, "Hutch++: optimal stochastic trace
estimation"; seed "Efficient DP-SGD for LLMs with Randomized Clipping", Algorithm 2 lines 7-12).

With ``S, P`` two ``n x k`` matrices of i.i.d. ``N(0, 1/k)`` entries (per parameter and step, DP randomness) and
``Q_i`` an orthonormal basis of ``M_i^T M_i S``: ``estimate_i = ||M_i Q_i||_F^2 + ||M_i P - (M_i Q_i)(Q_i^T P)||_F^2``,
unbiased. The sketch is Meyer et al.'s, not the seed's (docs/design.md section 4.3). Memory ``B (T + m + n) k`` per
parameter; materialised terms are exact.
"""

from __future__ import annotations

import torch

from lightning_dp.clipping.engines.base import register_engine
from lightning_dp.clipping.engines.hutch import RandomizedEngine
from lightning_dp.clipping.engines.projection import GradientOperator


@register_engine
class HutchPlusPlusEngine(RandomizedEngine):
    """Hutch++; see the module docstring."""

    name = "hutchpp"
    estimator = "hutchpp"

    def estimate(self, operator: GradientOperator, generator: torch.Generator) -> torch.Tensor:
        """Head ``||M Q||^2`` plus Hutchinson tail on the complement of ``Q``: ``[B]``."""
        k = self.projection_dim
        sketch = operator.gaussian(k, generator)
        tail_probe = operator.gaussian(k, generator)
        basis = torch.linalg.qr(operator.transposed_times(operator.times(sketch))).Q  # [B, n, r]
        head = operator.times(basis)  # [B, m, r]
        tail = operator.times(tail_probe) - torch.bmm(head, torch.matmul(basis.transpose(1, 2), tail_probe))
        return head.square().sum((1, 2)) + tail.square().sum((1, 2))
