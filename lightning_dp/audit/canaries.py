"""The canaries' random inclusion: each of ``m`` canaries is in the training input independently with probability
1/2 (Steinke, Nasr & Jagielski 2023, Algorithm 1, step 1), drawn from the audit's own generator, never the global
RNG and never the run's noise or sampling generators (the audit must not perturb the run it audits).
"""

from __future__ import annotations

import torch

from lightning_dp.runtime.randomness import os_seed


def audit_generator(seed: int | None) -> torch.Generator:
    """A CPU generator for the audit's draws, seeded with ``seed`` or, when ``None``, 63 bits of OS entropy."""
    seed = seed if seed is not None else os_seed() >> 1
    return torch.Generator().manual_seed(int(seed))


def draw_inclusion(num_canaries: int, generator: torch.Generator) -> torch.Tensor:
    """``[num_canaries]`` booleans, each True with probability 1/2.

    Raises:
        ValueError: ``num_canaries < 1``.
    """
    if num_canaries < 1:
        raise ValueError(f"num_canaries must be >= 1, got {num_canaries}")
    return torch.rand(num_canaries, generator=generator) < 0.5
