"""Accountant of buffered-linear-Toeplitz (BLT) matrix factorization under b-min-separated participation, without
amplification: an upper bound through the min-separation sensitivity.

**The mechanism.** ``n`` steps; ``x_t`` is step ``t``'s sum of clipped gradients (clip norm 1; the noise is scaled by
the clip norm separately). The released stream is ``C x + sigma Z`` (``Z`` standard normal, one row per step), or its
post-processing ``x + sigma C^{-1} Z`` (the noisy gradients), for a lower-triangular Toeplitz BLT ``C`` with
``c_0 = 1`` and ``c_k = sum_j w_j theta_j^(k-1)`` (Dvijotham et al. 2024; McMahan et al. 2024).

**The participation.** Every example takes part in steps at least ``b`` apart, at most ``k = ceil(n / b)`` of the
``n``: the cyclic sampler over ``b`` groups (step ``t`` samples only group ``t mod b``) gives it whatever its rate
within the group. This accountant credits no amplification from that sampling: it holds for ANY participation pattern
with separation ``>= b`` and at most ``k`` participations, random or fixed.

**The bound.** Under add/remove adjacency the released ``C x + sigma Z`` of neighbouring datasets differ in the mean
only, by ``C u`` with ``u`` the added or removed example's clipped gradients on its steps (rows of norm at most 1 on
a b-separated pattern, zero elsewhere). Conditioned on the participation of every other example (independent of that
example's) the two outputs are Gaussians whose means differ by at most the sensitivity
``sens(C) = sup ||C u||_F`` (:func:`~lightning_dp.correlated_noise.sensitivity.minsep_sensitivity`; exact for a
BLT with ``w_j >= 0``, ``0 <= theta_j <= 1``, ``sum w_j <= 1``, Kalinin and Lampert 2024, Theorem 2; a sound upper
bound otherwise); a random pattern of that example is a mixture of such pairs, which by the joint convexity of the
hockey-stick divergence is no less private than the worst pair. So the run is ``(epsilon, delta)``-DP for the
Gaussian mechanism with noise multiplier ``sigma / sens(C)`` (Denisov et al. 2022, Theorem 2.1: adaptively chosen
gradients do not change this for a lower-triangular ``C`` and Gaussian noise). The prefix of ``t`` released rows is
the ``t x t`` leading block of ``C``, Toeplitz with the same coefficients: epsilon after ``t`` steps uses
``sens`` of ``n = t``.

**Segments.** A resume restarts the stream (its state is noise and never checkpointed): the run's strategy becomes
block-diagonal, one block per segment of ``n_i`` steps. The blocks' releases compose as Gaussians, so the whole run
is the Gaussian mechanism with ``sigma / sqrt(sum_i sens_i^2)``; each example participates in each block at most
``ceil(n_i / b)`` times.

**Computation.** dp-accounting's PLD of ``GaussianDpEvent(sigma / sqrt(sum_i sens_i^2))`` (one Gaussian, so the
PLD is that of the Gaussian mechanism; pessimistic discretisation ``1e-4``, as the ``pld`` accountant's). It is an
upper bound on the correlated mechanism's privacy loss: amplification by sampling, which the cyclic sampler also
provides, is not credited (no theorem for BLT under it that this library implements; Choquette-Choo et al. 2024
estimate it by Monte Carlo).

Registered as ``"blt-minsep"``: the default, and the only accountant accepted, of ``noise_correlation='blt'``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import dp_accounting
from dp_accounting import pld

from lightning_dp.accounting.base import register_accountant
from lightning_dp.accounting.events import register_event
from lightning_dp.accounting.segments import SegmentedAccountant
from lightning_dp.correlated_noise.sensitivity import minsep_sensitivity
from lightning_dp.correlated_noise.strategies import BufferedToeplitz

#: Loss-grid spacing of the PLD (the ``pld`` accountant's).
VALUE_DISCRETIZATION_INTERVAL = 1e-4


@register_event
@dataclasses.dataclass(frozen=True)
class BLTMinSepEvent:
    """One step of BLT matrix factorization under ``b``-min-separated participation (module docstring).

    Attributes:
        noise_multiplier: ``sigma``, the standard deviation of the noise on ``C x`` (per coordinate and row) in units
            of the clip norm, ``>= 0``.
        num_groups: ``b >= 1``, the minimum separation of two participations of one example (the cyclic groups).
        decays: the BLT's ``theta_j``, ``[d]``.
        scales: the BLT's ``w_j``, ``[d]``.
        segment: ``>= 0``, the piece of the run since the stream last restarted (module docstring, "Segments").
    """

    noise_multiplier: float
    num_groups: int
    decays: tuple[float, ...]
    scales: tuple[float, ...]
    segment: int = 0

    def __post_init__(self) -> None:  # plain Python values, so that the ledger's state is JSON and compares equal
        if isinstance(self.noise_multiplier, numbers.Real):
            object.__setattr__(self, "noise_multiplier", float(self.noise_multiplier))
        for field in ("decays", "scales"):
            object.__setattr__(self, field, tuple(float(v) for v in getattr(self, field)))
        for field in ("num_groups", "segment"):
            value = getattr(self, field)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                object.__setattr__(self, field, int(value))

    @property
    def strategy(self) -> BufferedToeplitz:
        """The event's ``C``."""
        return BufferedToeplitz(self.decays, self.scales)


def validate_blt_minsep_event(event: BLTMinSepEvent) -> None:
    """Raise ``ValueError`` (one line saying what to change) unless the event's parameters are valid."""
    if not (event.noise_multiplier >= 0 and math.isfinite(event.noise_multiplier)):
        raise ValueError(f"noise_multiplier must be finite and >= 0, got {event.noise_multiplier}")
    if isinstance(event.num_groups, bool) or not isinstance(event.num_groups, numbers.Integral) or event.num_groups < 1:
        raise ValueError(f"num_groups (b, the minimum separation) must be an integer >= 1, got {event.num_groups!r}")
    if isinstance(event.segment, bool) or not isinstance(event.segment, numbers.Integral) or event.segment < 0:
        raise ValueError(f"segment must be an integer >= 0, got {event.segment!r}")
    event.strategy  # noqa: B018  (the strategy's own checks: lengths, finite values)


def blt_sensitivity(strategy: BufferedToeplitz, steps: int, num_groups: int) -> float:
    """``sens(C)`` of the ``steps x steps`` BLT under ``num_groups``-min-separation with ``ceil(steps / b)``
    participations (clip norm 1; exact for a monotone BLT, else an upper bound): see
    :func:`~lightning_dp.correlated_noise.sensitivity.minsep_sensitivity`.

    Raises:
        ValueError: ``steps < 1`` or ``num_groups < 1``.
    """
    return minsep_sensitivity(strategy.toeplitz_coefs(steps), steps, num_groups)


@register_accountant
class BLTMinSepAccountant(SegmentedAccountant):
    """Epsilon and delta of BLT matrix factorization under ``b``-min-separated participation, no amplification
    (module docstring: the bound, its conditions, segments). Source: the min-separation sensitivity of
    Choquette-Choo et al. 2023 (Section 3) for the Toeplitz BLT of Dvijotham et al. 2024, exact for monotone BLTs by
    Kalinin and Lampert 2024 (Theorem 2)."""

    name = "blt-minsep"
    event_type = BLTMinSepEvent
    label = "BLT"
    keep = "the noise, the sample rate (b = floor(1 / q)) and C"
    note = "BLT MF, b-min-separation sensitivity, no amplification (an upper bound)"

    def validate(self, event: Any) -> None:
        validate_blt_minsep_event(event)

    @property
    def sensitivity(self) -> float:
        """``sqrt(sum over segments of sens(C; n_i, b)^2)`` (0 for an empty ledger), clip norm 1."""
        if not self.ledger:
            return 0.0
        first: BLTMinSepEvent = self.ledger[0][0]
        strategy = first.strategy
        return math.sqrt(sum(blt_sensitivity(strategy, n, first.num_groups) ** 2 for n in self.segment_steps()))

    def _gaussian(self) -> dp_accounting.DpEvent | None:
        """The whole run's ``GaussianDpEvent(sigma / sens)``; ``None`` when ``sigma = 0``."""
        sigma = self.ledger[0][0].noise_multiplier
        return None if sigma == 0 else dp_accounting.GaussianDpEvent(sigma / self.sensitivity)

    def _backend(self) -> pld.PLDAccountant:
        return pld.PLDAccountant(value_discretization_interval=VALUE_DISCRETIZATION_INTERVAL)

    def _epsilon(self, delta: float) -> float:
        event = self._gaussian()
        if event is None:
            return math.inf
        return float(self._backend().compose(event).get_epsilon(delta))
