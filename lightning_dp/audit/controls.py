"""TEST-ONLY breakage of a DP run, so that the audit can be shown to fail when it should.

:class:`NoiseScaledForTesting` wraps the run's real mechanism and multiplies every draw by a factor (0.1: the noise
is a tenth of what the accountant assumes) while its privacy event, and so the accountant and the printed epsilon,
stay those of the original mechanism. For Gaussian, Laplace and the Gamma-randomised Laplace (PLRV-O) noise,
multiplying a draw by ``s`` is exactly drawing with scale ``s`` times the original. Nothing in the library installs
it; only the audit's ``noise_factor_for_testing`` option (``ScaleNoiseForTesting``) and the tests do,
and the run's privacy summary then carries ``BROKEN_FOR_TESTING``.

:func:`scale_clipping_for_testing` breaks the clipping instead: it multiplies the threshold of the run's
:class:`~lightning_dp.clipping.PerSampleClipper` INSTANCE (its ``max_grad_norm`` attribute, read at every clip), so
per-sample gradients are clipped to ``factor * C`` while the mechanism, its noise scale and the accountant keep
assuming C. Only the audit's ``clipping_factor_for_testing`` option (``ScaleClippingForTesting``) and the tests
use it.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_dp.clipping.clipper import PerSampleClipper
from lightning_dp.mechanisms.base import NoiseMechanism


class NoiseScaledForTesting(NoiseMechanism):
    """``factor * mechanism.sample(...)`` with ``mechanism``'s privacy event: a deliberately BROKEN mechanism.

    Args:
        mechanism: the run's real, calibrated mechanism (it still draws the noise, from the run's generator).
        factor: multiplier of every draw, in (0, 1) to under-noise (e.g. 0.1).

    Raises:
        ValueError: ``factor`` outside (0, 1).
    """

    name = "noise-scaled-for-testing"

    def __init__(self, mechanism: NoiseMechanism, factor: float) -> None:
        if not 0.0 < factor < 1.0:
            raise ValueError(f"factor must lie in (0, 1) to under-noise the run, got {factor}")
        super().__init__(mechanism.max_grad_norm)
        self.mechanism = mechanism
        self.factor = float(factor)
        self.clip_norm = mechanism.clip_norm
        self.default_accountant = mechanism.default_accountant

    def sample(self, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return self.mechanism.sample(like, generator).mul_(self.factor)

    def step_event(self, sample_rate: float, num_params: int) -> Any:
        """The ORIGINAL mechanism's event: the accountant keeps assuming the full noise."""
        return self.mechanism.step_event(sample_rate, num_params)

    def expected_abs_noise(self) -> float:
        return self.factor * self.mechanism.expected_abs_noise()

    def describe(self) -> dict[str, float]:
        return {**self.mechanism.describe(), "factor_for_testing": self.factor}


def scale_clipping_for_testing(clipper: PerSampleClipper, factor: float) -> None:
    """TEST-ONLY: make ``clipper`` clip per-sample gradients to ``factor`` times its threshold C, while the noise and
    the accountant keep assuming C: a deliberately BROKEN clipper (sensitivity ``factor * C``).

    Args:
        clipper: the run's per-sample clipper (its instance attribute ``max_grad_norm`` is multiplied; the class and
            its code are untouched).
        factor: > 1, e.g. 10 for a clipper that clips to 10 C.

    Raises:
        ValueError: ``factor <= 1``; a clipper with clipping groups.
    """
    if not factor > 1.0:
        raise ValueError(f"factor must exceed 1 to clip too loosely, got {factor}")
    if clipper.groups is not None:
        raise ValueError("scale_clipping_for_testing scales one bound: the clipper clips by groups (clipping_groups)")
    clipper.max_grad_norm = float(clipper.max_grad_norm) * float(factor)
