"""The "advanced" Laplace mechanism: l2 clipping with the literature review's noise scale (section 4).

Noise and clipping are those of LAP2 (i.i.d. ``Lap(0, b)`` on the l2-clipped sum); what differs is how ``b`` is
chosen: literature review 4.4 sets ``b = (C / eps_0) sqrt(2 ln(1.25 / delta_0))`` with ``eps_0`` from advanced
composition (4.3) and ``delta_0 = delta / (2T)`` (``calibrate(noise="laplace-advanced", ...)``). That formula is
the Gaussian mechanism's, transplanted to Laplace noise; the guarantee actually reported defaults to the sound
LAP2 accountant (``"lap2"``), with ``"advanced"`` (the review's composition) available for comparison.
"""

from __future__ import annotations

from lightning_dp.accounting.composition import advanced_laplace_noise_scale
from lightning_dp.mechanisms.base import register_mechanism
from lightning_dp.mechanisms.lap2 import Lap2Mechanism
from lightning_dp.mechanisms.solver import CalibrationProblem, CalibrationResult


@register_mechanism
class LaplaceAdvancedMechanism(Lap2Mechanism):
    """``Lap(0, noise_scale)`` per coordinate on the l2-clipped sum, scale from literature review 4.4.

    Args:
        noise_scale: Laplace scale ``b > 0`` in gradient units.
        max_grad_norm: l2 clipping bound ``C > 0``.

    Raises:
        ValueError: non-positive or non-finite ``noise_scale`` or ``max_grad_norm``.
    """

    name = "laplace-advanced"
    default_accountant = "lap2"
    #: calibration defaults to the review's advanced composition (section 4.4), training to the sound "lap2"
    calibration_accountant = "advanced"
    comparison_accountants = ("advanced",)
    clip_search = None  # LAP2 Alg. 1 is not defined for the review's scale

    @classmethod
    def calibrate(cls, problem: CalibrationProblem) -> CalibrationResult:
        """With the ``"advanced"`` accountant, the literature review 4.4 scale (``advanced_laplace_noise_scale``, which
        also guards the review's per-step formula where it is not valid for Laplace noise); with any other
        accountant (e.g. the sound ``"lap2"``), root finding on it."""
        if problem.accountant != "advanced":
            return super().calibrate(problem)
        p = problem
        scale = advanced_laplace_noise_scale(p.target_epsilon, p.target_delta, p.steps, p.max_grad_norm, p.sample_rate)
        mechanism = cls(scale[2], p.max_grad_norm)
        return CalibrationResult(mechanism, problem.epsilon_of(mechanism), problem.accountant)
