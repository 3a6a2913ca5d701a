"""Engine ``hutchpp``: per-sample squared norms by Hutch++ (Meyer et al. 2021, "Hutch++: optimal stochastic trace
estimation"; seed "Efficient DP-SGD for LLMs with Randomized Clipping", Algorithm 2 lines 7-12).

The squared norm ``||M_i||_F^2 = tr(M_i^T M_i)`` is split into a head, computed exactly on a sketched subspace, and a
tail estimated by Hutchinson: with ``S, P`` two ``n x k`` matrices of i.i.d. ``N(0, 1/k)`` entries (fresh per
parameter and step, from the DP randomness), ``Q_i`` an orthonormal basis of ``M_i^T M_i S`` (reduced QR),

    estimate_i = ||M_i Q_i||_F^2 + ||M_i P - (M_i Q_i)(Q_i^T P)||_F^2,

which is unbiased (the tail is Hutchinson's estimate of ``tr((I - Q Q^T) M^T M (I - Q Q^T))`` given ``Q``) and
captures the top of the spectrum exactly, so its error is far below Hutchinson's for gradients with a decaying
spectrum. The seed writes the sketch as ``A^T (G S)`` (the range of ``M`` itself); we use ``M^T M S``, the range
of the trace argument, which is Meyer et al.'s construction. Memory ``B (T + m + n) k`` per parameter (the basis
is per sample); materialised terms are exact as in :mod:`~lightning_dp.clipping.engines.hutch`.
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
