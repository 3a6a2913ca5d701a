"""Workloads ``A`` (``n x n``, lower triangular) whose rows the training's iterates are linear in.

With the noisy gradients ``g_0..g_{n-1}`` the model after step ``t`` is ``x_0 - (A g)_t``; the matrix mechanism adds
noise ``C^{-1} Z`` to ``g``, so the noise in the iterates is ``A C^{-1} Z = B Z`` with ``B = A C^{-1}``.

- Prefix sums (SGD, constant learning rate): ``A[t, s] = 1`` for ``s <= t`` (Kairouz et al. 2021; Denisov et al.
  2022).
- SGD with heavy-ball momentum ``beta`` (``m_t = beta m_{t-1} + g_t``, ``x_t = x_{t-1} - eta_t m_t``):
  ``A[t, s] = sum_{r=s..t} eta_r beta^(r - s)``, i.e. ``A = P diag(eta) M`` with ``P`` the prefix sums and ``M`` the
  Toeplitz matrix of ``beta^k`` (Denisov et al. 2022: momentum and learning-rate schedules folded into the
  workload). With a constant learning rate (``eta = 1``; its scale does not change the optimal ``C``) ``A`` is
  Toeplitz with ``a_k = (1 - beta^(k + 1)) / (1 - beta)``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from lightning_dp.correlated_noise import toeplitz


@dataclasses.dataclass(frozen=True)
class Workload:
    """The workload of ``n`` steps of SGD with momentum ``beta`` and optional per-step learning rates (hashable, so
    the optimisers cache on it).

    Args:
        n: the number of steps, ``>= 1``.
        momentum: ``beta`` in ``[0, 1)``; 0 is plain prefix sums.
        learning_rates: ``eta_0..eta_{n-1}`` (``>= 0``, not all 0, e.g. a warm-up from 0; relative values matter,
            not their scale), or ``None`` for a constant rate (the Toeplitz workload).

    Raises:
        ValueError: ``n < 1``, ``momentum`` outside ``[0, 1)``, or ``learning_rates`` not ``n`` finite values ``>= 0``
            with one above 0.
    """

    n: int
    momentum: float = 0.0
    learning_rates: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "n", toeplitz.check_size(self.n))
        if not (isinstance(self.momentum, int | float) and 0.0 <= self.momentum < 1.0):
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}")
        object.__setattr__(self, "momentum", float(self.momentum))
        if self.learning_rates is not None:
            rates = tuple(float(r) for r in self.learning_rates)
            if len(rates) != self.n or not all(math.isfinite(r) and r >= 0 for r in rates) or max(rates) <= 0:
                raise ValueError(
                    f"learning_rates must be {self.n} finite values >= 0, not all 0 (one per step), got {len(rates)} "
                    "values"
                )
            object.__setattr__(self, "learning_rates", rates)

    @classmethod
    def with_schedule(cls, learning_rates: Sequence[float], momentum: float = 0.0) -> Workload:
        """The workload of the given per-step learning rates (``n = len(learning_rates)``)."""
        return cls(len(learning_rates), momentum, tuple(learning_rates))

    @property
    def is_toeplitz(self) -> bool:
        """Whether ``A`` is Toeplitz (constant learning rate)."""
        return self.learning_rates is None

    def momentum_coefs(self) -> np.ndarray:
        """``beta^k``, ``k < n``: the Toeplitz coefficients of ``M``, shape ``[n]``."""
        return self.momentum ** np.arange(self.n, dtype=np.float64)

    def toeplitz_coefs(self) -> np.ndarray:
        """The first column ``a`` of a Toeplitz ``A``: ``a_k = sum_{j <= k} beta^j``, shape ``[n]``.

        Raises:
            ValueError: the workload has a learning-rate schedule (not Toeplitz; use :meth:`matrix`).
        """
        if not self.is_toeplitz:
            raise ValueError("a workload with a learning-rate schedule is not Toeplitz; use Workload.matrix()")
        return np.cumsum(self.momentum_coefs())

    def matrix(self) -> np.ndarray:
        """The dense ``A``, shape ``[n, n]``."""
        if self.is_toeplitz:
            return toeplitz.materialize(self.toeplitz_coefs(), self.n)
        rates = np.asarray(self.learning_rates)
        prefix = np.tril(np.ones((self.n, self.n)))
        return prefix @ (rates[:, None] * toeplitz.materialize(self.momentum_coefs(), self.n))
