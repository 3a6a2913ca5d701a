"""PLRV-O: Gamma-randomised Laplace noise on the l2-clipped sum (PLRV-O seed, Def. 4.10, Alg. 3).

For every coordinate and every step, draw an inverse scale ``u ~ Gamma(k, theta)`` (shape ``k``, scale ``theta``)
and then ``z ~ Lap(0, 1/u)``. The noise is NOT multiplied by ``C``: the clipping bound enters only the accountant
(Thm 4.8-4.9, Alg. 2: the MGF of ``u`` is evaluated at multiples of ``C``), exactly as the reference code.
The expected distortion is ``E|z| = E[1/u] = 1 / ((k - 1) theta)`` for ``k > 1`` (Thm 5.1), so the
signal-to-noise objective of the search (Alg. 1) is ``C (k - 1) theta``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lightning_dp.accounting.events import PlrvEvent, PoissonSampledEvent
from lightning_dp.mechanisms.base import NoiseMechanism, check_positive, register_mechanism
from lightning_dp.mechanisms.solver import CalibrationProblem, CalibrationResult

if TYPE_CHECKING:
    import torch


@register_mechanism
class PlrvMechanism(NoiseMechanism):
    """Per coordinate ``u ~ Gamma(gamma_shape, gamma_scale)``, then ``Lap(0, 1/u)``, redrawn every step.

    Args:
        gamma_shape: Gamma shape ``k > 1`` (constraint c3: ``k <= 1`` gives infinite expected distortion).
        gamma_scale: Gamma scale ``theta > 0`` (inverse-scale units: ``u`` has mean ``k theta``).
        max_grad_norm: l2 clipping bound ``C > 0`` (used by the accountant only).

    Raises:
        ValueError: ``gamma_shape <= 1``, non-positive ``gamma_scale`` or ``max_grad_norm``, non-finite values.
    """

    name = "plrv"
    clip_norm = 2
    default_accountant = "plrv"
    needs_num_params = True
    supports_secure = True
    parameter_help = {"gamma_shape": "PLRV-O Gamma shape k > 1", "gamma_scale": "PLRV-O Gamma scale theta > 0"}
    comparison_accountants = ("plrv-paper",)
    clip_search = "PLRV-O Alg. 1"

    def __init__(self, gamma_shape: float, gamma_scale: float, max_grad_norm: float) -> None:
        super().__init__(max_grad_norm)
        hint = (
            "Use calibrate(noise='plrv', ...) or search_plrv(...) to pick (k, theta) (lightning-dp calibrate --noise "
            "plrv)."
        )
        self.gamma_shape = check_positive("gamma_shape", gamma_shape, hint)
        if self.gamma_shape <= 1.0:
            raise ValueError(
                f"gamma_shape must be > 1 (PLRV-O constraint c3: E|z| = 1/((k-1) theta) diverges otherwise), "
                f"got {gamma_shape}. {hint}"
            )
        self.gamma_scale = check_positive("gamma_scale", gamma_scale, hint)

    @classmethod
    def calibrate(cls, problem: CalibrationProblem) -> CalibrationResult:
        """``(k, theta)`` maximising ``(k - 1) theta`` under c1-c4 at fixed ``C``: PLRV-O Alg. 1
        (:func:`~lightning_dp.mechanisms.search_plrv.search_plrv`) with ``clip_range=(C, C)``."""
        return cls._search(problem, (problem.max_grad_norm, problem.max_grad_norm))

    @classmethod
    def _search(cls, problem: CalibrationProblem, clip_range: tuple[float, float]) -> CalibrationResult:
        """PLRV-O Alg. 1 for ``problem`` with the clipping bound searched in ``clip_range``."""
        from lightning_dp.mechanisms.search_plrv import search_plrv  # it builds this class: imported on use

        p = problem
        found = search_plrv(
            p.target_epsilon,
            p.target_delta,
            p.sample_rate,
            p.steps,
            p.num_params,
            accountant=p.accountant,
            clip_range=clip_range,
        )
        return CalibrationResult(found.mechanism(), found.epsilon, p.accountant)

    def sample(self, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        from lightning_dp.mechanisms.sampling import inverse_gamma_scales, sample_laplace  # torch: imported on use

        scales = inverse_gamma_scales(like, self.gamma_shape, self.gamma_scale, generator)
        return sample_laplace(like, scales, generator)

    @classmethod
    def search_clipping(cls, problem: CalibrationProblem) -> CalibrationResult:
        """PLRV-O Alg. 1 (:func:`~lightning_dp.mechanisms.search_plrv.search_plrv`) over ``C`` in ``[C/2, C]``."""
        return cls._search(problem, (problem.max_grad_norm / 2, problem.max_grad_norm))

    def secure_sample(self, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """The Gamma inverse scales as in :meth:`sample`, then the hardened Laplace sampler
        (:func:`~lightning_dp.mechanisms.secure.secure_laplace`)."""
        from lightning_dp.mechanisms.sampling import inverse_gamma_scales
        from lightning_dp.mechanisms.secure import secure_laplace

        scales = inverse_gamma_scales(like, self.gamma_shape, self.gamma_scale, generator)
        return secure_laplace(like, scales, generator)

    def step_event(self, sample_rate: float, num_params: int) -> PoissonSampledEvent:
        """``PoissonSampledEvent(q, PlrvEvent(k, theta, C, num_params))``."""
        event = PlrvEvent(self.gamma_shape, self.gamma_scale, self.max_grad_norm, int(num_params))
        return PoissonSampledEvent(sample_rate, event)

    def expected_abs_noise(self) -> float:
        """``E|z| = 1 / ((k - 1) theta)`` (PLRV-O Thm 5.1)."""
        return 1.0 / ((self.gamma_shape - 1.0) * self.gamma_scale)

    def describe(self) -> dict[str, float]:
        return {"gamma_shape": self.gamma_shape, "gamma_scale": self.gamma_scale, "max_grad_norm": self.max_grad_norm}
