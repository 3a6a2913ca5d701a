"""One epsilon for a whole private search: dp-accounting's RDP accountant on
``RepeatAndSelectDpEvent(<one candidate's event>, mean, shape)`` (Papernot & Steinke 2022, Theorems 2 and 6).

Every candidate spends the same event: ``steps`` Poisson-subsampled Gaussian steps at ``noise_multiplier`` and
``sample_rate`` (a hyper-parameter that would change it is refused by :mod:`lightning_dp.tuning.space`). The orders are
those of the library's ``rdp`` accountant (:class:`~lightning_dp.accounting.gaussian.RDPAccountant`).
"""

from __future__ import annotations

import dataclasses
import math
from functools import cached_property

from dp_accounting import dp_event, rdp

from lightning_dp.accounting.events import GaussianEvent, PoissonSampledEvent
from lightning_dp.accounting.gaussian import RDPAccountant, quiet_rdp_convergence, to_dp_accounting_event
from lightning_dp.mechanisms.solver import closed_form_noise_ratio, solve_monotone
from lightning_dp.tuning.repetitions import RepetitionDistribution


def _rdp_epsilon(event: dp_event.DpEvent, delta: float) -> float:
    accountant = rdp.RdpAccountant(orders=RDPAccountant.orders)
    with quiet_rdp_convergence():
        return float(accountant.compose(event).get_epsilon(delta))


@dataclasses.dataclass(frozen=True)
class SearchPlan:
    """The privacy of a search: what every candidate runs with, the law of ``K``, and the guarantee.

    Attributes:
        noise_multiplier: ``sigma``, the Gaussian noise of every candidate (standard deviation ``sigma C`` on the sum
            clipped at ``C``).
        sample_rate: every candidate's Poisson rate ``q`` in ``(0, 1]``.
        steps: every candidate's number of optimizer steps ``T``.
        target_delta: delta of the reported epsilon, in ``(0, 1)``.
        repetitions: the law of ``K``; its shape must be ``>= 0`` or ``inf`` (dp-accounting's domain).

    Raises:
        ValueError: a parameter out of range.
    """

    noise_multiplier: float
    sample_rate: float
    steps: int
    target_delta: float
    repetitions: RepetitionDistribution

    def __post_init__(self) -> None:
        if not 0.0 < self.noise_multiplier < math.inf:
            raise ValueError(f"noise_multiplier must be a positive finite number, got {self.noise_multiplier}")
        if not 0.0 < self.sample_rate <= 1.0:
            raise ValueError(
                f"sample_rate must lie in (0, 1] (expected batch size / dataset size), got {self.sample_rate}"
            )
        if int(self.steps) != self.steps or self.steps < 1:
            raise ValueError(f"steps must be a positive integer (each candidate's optimizer steps), got {self.steps}")
        if not 0.0 < self.target_delta < 1.0:
            raise ValueError(f"target_delta must lie in (0, 1), below 1/N, got {self.target_delta}")
        if self.repetitions.shape < 0:
            raise ValueError(
                f"shape must be 0 (logarithmic), positive (1: geometric) or inf (Poisson) for the search's accounting, "
                f"got {self.repetitions.shape}: dp-accounting's RepeatAndSelectDpEvent covers shape >= 0 only"
            )

    @classmethod
    def for_target_epsilon(
        cls,
        target_epsilon: float,
        *,
        sample_rate: float,
        steps: int,
        target_delta: float,
        repetitions: RepetitionDistribution,
    ) -> SearchPlan:
        """The plan whose noise multiplier makes the whole search's epsilon lie in ``[(1 - RTOL) target, target]``
        (:func:`~lightning_dp.mechanisms.solver.solve_monotone`).

        Raises:
            ValueError: an invalid target, or one no noise multiplier in ``[1e-3, 1e4]`` reaches.
        """
        if not 0.0 < target_epsilon < math.inf:
            raise ValueError(f"target_epsilon must be a positive finite number, got {target_epsilon}")

        def plan(sigma: float) -> SearchPlan:
            return cls(sigma, sample_rate, steps, target_delta, repetitions)

        plan(1.0)  # the schedule and delta checked before any accounting
        start = max(closed_form_noise_ratio(target_epsilon, target_delta, sample_rate, steps), 1e-2)
        sigma, _ = solve_monotone(
            lambda sigma: plan(sigma).epsilon, target_epsilon, initial=start, increasing=False, bounds=(1e-3, 1e4)
        )
        return plan(sigma)

    def candidate_event(self) -> dp_event.DpEvent:
        """One candidate's event: ``steps`` Poisson-subsampled Gaussian steps."""
        step = to_dp_accounting_event(PoissonSampledEvent(self.sample_rate, GaussianEvent(self.noise_multiplier)))
        return dp_event.SelfComposedDpEvent(step, int(self.steps))

    def search_event(self) -> dp_event.DpEvent:
        """The whole search's event: ``RepeatAndSelectDpEvent(candidate_event, mean, shape)``."""
        return dp_event.RepeatAndSelectDpEvent(
            self.candidate_event(), float(self.repetitions.mean), float(self.repetitions.shape)
        )

    @cached_property
    def epsilon(self) -> float:
        """Epsilon of the whole search (its winner, the winner's score and ``K = 0``'s empty output) at
        ``target_delta``."""
        return _rdp_epsilon(self.search_event(), self.target_delta)

    @cached_property
    def candidate_epsilon(self) -> float:
        """Epsilon of one candidate alone, by the same accountant (for comparison; not a guarantee of the search)."""
        return _rdp_epsilon(self.candidate_event(), self.target_delta)

    def describe(self) -> dict[str, float | int]:
        """The plan as plain data (the search's fingerprint and report)."""
        return {
            "noise_multiplier": float(self.noise_multiplier),
            "sample_rate": float(self.sample_rate),
            "steps": int(self.steps),
            "target_delta": float(self.target_delta),
            "mean_repetitions": float(self.repetitions.mean),
            "shape": float(self.repetitions.shape),
        }
