"""LAP2: i.i.d. Laplace noise on the l2-clipped sum (LAP2 seed, Alg. 2 and Thm III.7).

Per-sample gradients are clipped in l2 to ``C`` (as in Gaussian DP-SGD) and ``Lap(0, b)`` is added to every
coordinate of the clipped sum once per step. Privacy is accounted by the majorization moments accountant: the
sound variant ``"lap2"`` (docs/design.md section 6.4, the default) or the paper's bound ``"lap2-paper"`` (eq. III.7).
Both depend on ``(C, b)`` only through ``C / b`` (eq. III.8 uses ``x_i / b`` with ``x_i`` proportional to ``C``).
"""

from __future__ import annotations

from typing import ClassVar

from lightning_dp.accounting.events import Lap2Event, PoissonSampledEvent
from lightning_dp.mechanisms.base import register_mechanism
from lightning_dp.mechanisms.laplace import IidLaplaceNoise
from lightning_dp.mechanisms.solver import CalibrationProblem, CalibrationResult


@register_mechanism
class Lap2Mechanism(IidLaplaceNoise):
    """I.i.d. ``Lap(0, noise_scale)`` per coordinate on the sum of l2-clipped per-sample gradients.

    Args:
        noise_scale: Laplace scale ``b > 0`` in gradient units (not a multiplier of ``C``).
        max_grad_norm: l2 clipping bound ``C > 0``.

    Raises:
        ValueError: non-positive or non-finite ``noise_scale`` or ``max_grad_norm``.
    """

    name = "lap2"
    clip_norm = 2
    default_accountant = "lap2"
    needs_num_params = True
    comparison_accountants = ("lap2-paper",)
    clip_search: ClassVar[str | None] = "LAP2 Alg. 1"  # LaplaceAdvancedMechanism sets None
    scale_hint = (
        "Use calibrate(noise={name!r}, ...) or search_lap2(...) to pick it (lightning-dp calibrate --noise {name})."
    )

    def step_event(self, sample_rate: float, num_params: int) -> PoissonSampledEvent:
        """``PoissonSampledEvent(q, Lap2Event(b, C, num_params))`` over the ``num_params`` noised coordinates."""
        return PoissonSampledEvent(sample_rate, Lap2Event(self.noise_scale, self.max_grad_norm, int(num_params)))

    @classmethod
    def search_clipping(cls, problem: CalibrationProblem) -> CalibrationResult:
        """LAP2 Alg. 1 (:func:`~lightning_dp.mechanisms.search_lap2.search_lap2`) with ``max_clip = C``."""
        from lightning_dp.mechanisms.search_lap2 import search_lap2  # it builds this class: imported on use

        p = problem
        found = search_lap2(
            p.target_epsilon,
            p.target_delta,
            p.sample_rate,
            p.steps,
            num_params=p.num_params,
            accountant=p.accountant,
            max_clip=p.max_grad_norm,
        )
        return CalibrationResult(found.mechanism(), found.epsilon, p.accountant)
