"""Optimizer wrappers: noise on the clipped sum, scaling, accumulation."""

from lightning_dp.optim.dp_optimizer import DPOptimizer, NoiseGenerators

__all__ = ["DPOptimizer", "NoiseGenerators"]
