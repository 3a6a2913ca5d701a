"""Optimizer wrapper (noise on the clipped sum, scaling, accumulation), the low-pass filter (post-processing of the
noisy gradient), the run's dedicated generators, and the collectives of multi-process runs.

The generators live in :mod:`lightning_dp.runtime.randomness` and the collectives in
:mod:`lightning_dp.runtime.distributed`; both are re-exported here, where the public API has always offered them.
"""

from lightning_dp.optim.dp_optimizer import DPOptimizer
from lightning_dp.optim.lowpass import LOWPASS_PRESETS, LowPassFilter, make_lowpass
from lightning_dp.runtime.distributed import DistributedContext, distributed_context
from lightning_dp.runtime.randomness import DPRandomness, derive_seed

__all__ = [
    "LOWPASS_PRESETS",
    "DPOptimizer",
    "DPRandomness",
    "DistributedContext",
    "LowPassFilter",
    "derive_seed",
    "distributed_context",
    "make_lowpass",
]
