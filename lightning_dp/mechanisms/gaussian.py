"""Gaussian mechanism ``N(0, (sigma C)^2 I)`` on the l2-clipped sum (Abadi et al. 2016, DP-SGD)."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, cast

from lightning_dp.accounting.events import GaussianEvent, PoissonSampledEvent
from lightning_dp.mechanisms.base import NoiseMechanism, register_mechanism
from lightning_dp.mechanisms.solver import CalibrationProblem

if TYPE_CHECKING:
    import torch

#: Smallest Gaussian noise multiplier calibrated with the PLD accountant. The PLD grid of dp-accounting grows as sigma
#: falls (measured at q = 0.01, T = 1000 on one core: sigma 0.5 -> 3.6 s, 0.3 -> 7 s, 0.1 -> 99 s and 2.3 GB), while
#: such noise already means epsilon in the tens or more; below it calibration stops with a clear error (the cheap
#: RDP warm start tells within seconds).
PLD_MIN_NOISE_MULTIPLIER = 0.3


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
    calibrated_parameter = "noise_multiplier"
    parameter_help = {"noise_multiplier": "Gaussian sigma, noise std = sigma * C"}
    supports_secure = True
    piecewise = True

    def __init__(self, noise_multiplier: float, max_grad_norm: float) -> None:
        super().__init__(max_grad_norm)
        if not noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
        self.noise_multiplier = float(noise_multiplier)

    def sample(self, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Drawn in at least float32 and then cast, so 16-bit gradients do not get coarsely quantised noise."""
        from lightning_dp.mechanisms.sampling import sample_gaussian  # torch: imported on use

        return sample_gaussian(like, self.noise_multiplier * self.max_grad_norm, generator)

    def secure_sample(self, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Sum of 4 Gaussian draws divided by 2 (:func:`~lightning_dp.mechanisms.secure.secure_gaussian`)."""
        from lightning_dp.mechanisms.secure import secure_gaussian

        return secure_gaussian(like, self.noise_multiplier * self.max_grad_norm, generator)

    @classmethod
    def calibration_start(cls, problem: CalibrationProblem) -> tuple[float, float]:
        """Warm start from the cheap RDP calibration (its sigma is a few % above PLD's); with ``"pld"``, stop with
        a clear error below :data:`PLD_MIN_NOISE_MULTIPLIER`."""
        if problem.accountant == "rdp":
            return super().calibration_start(problem)
        warm = cls.calibrate(dataclasses.replace(problem, accountant="rdp")).mechanism
        sigma = cast(GaussianMechanism, warm).noise_multiplier
        if problem.accountant == "pld" and sigma < PLD_MIN_NOISE_MULTIPLIER:
            raise ValueError(
                f"target_epsilon={problem.target_epsilon:g} needs a noise multiplier of about "
                f"{sigma:.3g} (RDP estimate), below {PLD_MIN_NOISE_MULTIPLIER}: such "
                "little noise gives no meaningful privacy, and the PLD accountant's grid would grow to minutes "
                "and gigabytes. Lower the target (epsilon <= 10 is typical), or calibrate with accountant='rdp' "
                "(sound, a few % looser, cheap at any noise)"
            )
        return 0.97 * sigma, 1.05

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
