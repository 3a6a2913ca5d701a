"""Independent computations the correlated-noise tests check the library against: the analytic Gaussian mechanism
(Balle and Wang 2018, Theorem 8, with scipy) and a brute-force min-separation sensitivity of a dense ``C``."""

from __future__ import annotations

import itertools
import math

import numpy as np
from scipy import optimize, stats

from lightning_dp.correlated_noise import BufferedToeplitz


def analytic_gaussian_epsilon(mu: float, delta: float) -> float:
    """Epsilon at ``delta`` of the Gaussian mechanism with sensitivity over noise ``mu`` (Balle and Wang 2018)."""

    def delta_of(eps: float) -> float:
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)

    return optimize.brentq(lambda eps: delta_of(eps) - delta, 1e-9, 500.0, xtol=1e-12)


def brute_force_sensitivity(strategy: BufferedToeplitz, n: int, min_sep: int) -> float:
    """``max ||C 1_pi||`` over every pattern ``pi`` of ``range(n)`` whose steps are ``min_sep`` apart: the
    sensitivity when aligned gradients are the worst case (``C^T C >= 0``, true of a BLT with positive parameters)."""
    dense = strategy.dense(n)
    assert (dense.T @ dense >= 0).all()
    best = 0.0
    for size in range(1, math.ceil(n / min_sep) + 1):
        for pattern in itertools.combinations(range(n), size):
            if all(b - a >= min_sep for a, b in itertools.pairwise(pattern)):
                best = max(best, float(np.linalg.norm(dense[:, list(pattern)].sum(axis=1))))
    return best
