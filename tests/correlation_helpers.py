"""Independent computations the correlated-noise tests check the library against: the analytic Gaussian mechanism
(Balle and Wang 2018, Theorem 8, with scipy) and a brute-force min-separation sensitivity of a dense ``C``; and what
the sharded zero-gradient runs record (the FSDP2 scripts of both adapters) and the noise read back from it."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import torch
from scipy import optimize, stats
from torch.distributed.tensor import DTensor

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


def zero_gradient_run(engine: Any, iterates: list[torch.Tensor], module: torch.nn.Module) -> dict[str, Any]:
    """What a zero-gradient run records: the flattened gathered parameters before training and after every step,
    the expected batch ``q N``, the plan's strategy and scale ``s`` (``None`` for independent noise), epsilon, the
    privacy summary and whether ``module`` is sharded."""
    plan = engine.state.correlation
    return {
        "params": torch.stack(iterates),
        "expected_batch": engine.sample_rate * engine.num_samples,
        "strategy": None if plan is None else plan.strategy,
        "scale": None if plan is None else plan.scale,
        "epsilon": engine.epsilon(),
        "summary": engine.summary(),
        "sharded": any(isinstance(p, DTensor) for p in module.parameters()),
    }


def noise_per_step(run: dict[str, Any]) -> torch.Tensor:
    """``[steps, coordinates]``: each step's noise on the clipped sum of a :func:`zero_gradient_run` (SGD at
    learning rate 1 on zero gradients moves the parameters by minus the noise over the expected batch)."""
    params = run["params"].double()
    return -(params[1:] - params[:-1]) * run["expected_batch"]
