"""Optimizer wrapper (noise on the clipped sum, scaling, accumulation) and the run's dedicated generators."""

from lightning_dp.optim.dp_optimizer import DPOptimizer
from lightning_dp.optim.randomness import DPRandomness, derive_seed

__all__ = ["DPOptimizer", "DPRandomness", "derive_seed"]
