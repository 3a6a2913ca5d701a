"""Gaussian mechanism ``N(0, (sigma C)^2 I)`` on the l2-clipped sum (Abadi et al. 2016, DP-SGD)."""

from __future__ import annotations

import math

import torch

from lightning_dp.accounting.events import GaussianEvent, PoissonSampledEvent
from lightning_dp.mechanisms.base import NoiseMechanism, register_mechanism


@register_mechanism
class GaussianMechanism(NoiseMechanism):
    """Isotropic Gaussian noise with std ``noise_multiplier * max_grad_norm`` per coordinate.

    Args:
        noise_multiplier: sigma >= 0 (0 disables noise: only for debugging, epsilon is then infinite).
        max_grad_norm: l2 clipping bound C > 0.

    Raises:
        ValueError: negative ``noise_multiplier`` or non-positive ``max_grad_norm``.
    """

    name = "gaussian"
    clip_norm = 2
    default_accountant = "pld"

    def __init__(self, noise_multiplier: float, max_grad_norm: float) -> None:
        super().__init__(max_grad_norm)
        if not noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
        self.noise_multiplier = float(noise_multiplier)

    def sample(self, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Drawn in at least float32 and then cast, so 16-bit gradients do not get coarsely quantised noise."""
        std = self.noise_multiplier * self.max_grad_norm
        work = torch.float32 if like.dtype in (torch.float16, torch.bfloat16) else like.dtype
        noise = torch.empty(like.shape, dtype=work, device=like.device)
        noise = noise.normal_(mean=0.0, std=std, generator=generator) if std > 0 else noise.zero_()
        return noise.to(like.dtype)

    def step_event(self, sample_rate: float, num_params: int) -> PoissonSampledEvent:
        return PoissonSampledEvent(sample_rate, GaussianEvent(self.noise_multiplier))

    def expected_abs_noise(self) -> float:
        """``sigma C sqrt(2/pi)``."""
        return self.noise_multiplier * self.max_grad_norm * math.sqrt(2.0 / math.pi)

    @property
    def is_noiseless(self) -> bool:
        return self.noise_multiplier == 0

    def describe(self) -> dict[str, float]:
        return {"noise_multiplier": self.noise_multiplier, "max_grad_norm": self.max_grad_norm}
