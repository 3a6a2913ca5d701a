"""Optimizer wrapper (noise on the clipped sum, scaling, accumulation), the run's dedicated generators, and the
collectives of multi-process runs."""

from lightning_dp.optim.distributed import DistributedContext, distributed_context
from lightning_dp.optim.dp_optimizer import DPOptimizer
from lightning_dp.optim.randomness import DPRandomness, derive_seed

__all__ = ["DPOptimizer", "DPRandomness", "DistributedContext", "derive_seed", "distributed_context"]
