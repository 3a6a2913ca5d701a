"""Traditional Laplace mechanism on the l1-clipped sum (Dwork et al. 2006; literature review section 3).

Each per-sample gradient is clipped to l1 norm ``C``, so adding or removing one example moves the sum by at most
``C`` in l1 (literature review 3.2, add/remove neighbours). I.i.d. ``Lap(0, b)`` noise per coordinate then makes one
step ``C / b``-DP (pure, Theorem III.1 of the LAP2 seed); with ``b = C / eps_step`` and basic (sequential)
composition over ``T`` steps the run is ``T * eps_step``-DP (literature review 3.3, 7.1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_dp.accounting.composition import basic_laplace_noise_scale
from lightning_dp.accounting.events import LaplaceEvent, PoissonSampledEvent
from lightning_dp.mechanisms.base import NoiseMechanism, check_positive, register_mechanism
from lightning_dp.mechanisms.solver import CalibrationProblem

if TYPE_CHECKING:
    import torch


class IidLaplaceNoise(NoiseMechanism):
    """Shared part of the Laplace mechanisms: i.i.d. ``Lap(0, noise_scale)`` per coordinate on the clipped sum.

    Subclasses fix the clipping norm, the privacy event and the accountant.

    Args:
        noise_scale: Laplace scale ``b > 0`` in gradient units (not a multiplier of ``C``).
        max_grad_norm: clipping bound ``C > 0`` (in the subclass's ``clip_norm``).

    Raises:
        ValueError: non-positive or non-finite ``noise_scale`` or ``max_grad_norm``.
    """

    #: how to choose ``noise_scale``, appended to the validation message (``{name}`` is the mechanism's name).
    scale_hint: str = ""
    calibrated_parameter = "noise_scale"
    parameter_help = {"noise_scale": "Laplace scale b"}
    supports_secure = True

    def __init__(self, noise_scale: float, max_grad_norm: float) -> None:
        super().__init__(max_grad_norm)
        self.noise_scale = check_positive("noise_scale", noise_scale, self.scale_hint.format(name=self.name))

    @classmethod
    def calibration_start(cls, problem: CalibrationProblem) -> tuple[float, float]:
        """The closed-form ratio times ``C``: ``b ~ (2 q / eps) sqrt(T log(1/delta)) C`` (LAP2 seed Sec. IV-B)."""
        return problem.noise_ratio() * problem.max_grad_norm, 2.0

    def sample(self, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        from lightning_dp.mechanisms.sampling import sample_laplace  # torch: imported on use

        return sample_laplace(like, self.noise_scale, generator)

    def secure_sample(self, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Four uniforms per sample (:func:`~lightning_dp.mechanisms.secure.secure_laplace`)."""
        from lightning_dp.mechanisms.secure import secure_laplace

        return secure_laplace(like, self.noise_scale, generator)

    def expected_abs_noise(self) -> float:
        """``E|z| = b`` for ``z ~ Lap(0, b)``."""
        return self.noise_scale

    def describe(self) -> dict[str, float]:
        return {"noise_scale": self.noise_scale, "max_grad_norm": self.max_grad_norm}


@register_mechanism
class LaplaceMechanism(IidLaplaceNoise):
    """I.i.d. ``Lap(0, noise_scale)`` per coordinate on the sum of l1-clipped per-sample gradients.

    Args:
        noise_scale: Laplace scale ``b > 0`` in gradient units; ``b = C / eps_step`` gives ``eps_step``-DP per step
            (use :func:`lightning_dp.mechanisms.calibration.calibrate` to pick it for a target epsilon).
        max_grad_norm: l1 clipping bound ``C > 0``.

    Raises:
        ValueError: non-positive or non-finite ``noise_scale`` or ``max_grad_norm``.
    """

    name = "laplace"
    clip_norm = 1
    default_accountant = "basic"
    scale_hint = (
        "Pick b = max_grad_norm / eps_step, or calibrate(noise='laplace', ...) (lightning-dp calibrate --noise "
        "laplace)."
    )

    @classmethod
    def calibration_start(cls, problem: CalibrationProblem) -> tuple[float, float]:
        """Literature review 3.3's scale (``b = C T / eps`` for ``q = 1``; with the subsampling amplification
        inverted otherwise, ``basic_laplace_noise_scale``), then checked and refined on the accountant."""
        p = problem
        return basic_laplace_noise_scale(p.target_epsilon, p.steps, p.max_grad_norm, p.sample_rate)[1], 2.0

    def step_event(self, sample_rate: float, num_params: int) -> PoissonSampledEvent:
        """``PoissonSampledEvent(q, LaplaceEvent(b, C))``; ``num_params`` does not matter for l1 sensitivity."""
        return PoissonSampledEvent(sample_rate, LaplaceEvent(self.noise_scale, self.max_grad_norm))
