"""Banded matrix-factorization noise as a training option (``noise_correlation='banded'``): the run's strategy, the
scale of its noise, its privacy event and its noise stream (docs/design.md section 5.1).

With band ``b``, nominal rate ``q`` and ``n`` planned steps:

- the strategy ``C`` is :func:`~lightning_dp.correlated_noise.optimize_banded` ``(n, b, max_participations=1)``
  (prefix-sum workload, the amplified case), or the checkpoint's coefficients on resume;
- the noise added to step ``t``'s clipped sum is ``sigma C_clip s (C^{-1} Z)_t``, ``s`` the largest column norm of
  ``C``: ``Z_t`` is drawn by the Gaussian mechanism ``N(0, (sigma s C_clip)^2)`` (:attr:`BandedPlan.sum_mechanism`,
  from the run's dedicated noise generators, hardened in ``secure_mode``) and correlated by a fresh
  :class:`~lightning_dp.correlated_noise.BandedNoise` per optimizer (:meth:`BandedPlan.noise_stream`; by
  linearity ``C^{-1}`` may take the scaled draw). ``b = 1``: ``C = I``, ``s = 1``, DP-SGD's noise bit for bit;
- one step's event is :class:`~lightning_dp.accounting.banded_mf.BandedMFEvent` ``(sigma s, q_b = b q, b, s,
  segment)``: the release ``C x + sigma s Z`` with column norms at most ``s``, so the ``banded-mf`` accountant reports
  DP-SGD's epsilon at rate ``q_b`` and noise multiplier ``sigma`` for ``k = ceil(n / b)`` steps per segment.

**Segments.** The streaming state (the last ``b - 1`` noise outputs) is noise, so it is never written to a
checkpoint: each start of training (a resume, a second ``fit``) starts a new stream, which makes the run's strategy
block-diagonal. Each block is again lower triangular with band at most ``b`` and column norms at most ``s`` (a column
cut at a block's end only loses entries), which is all the accountant needs of ``C``; and the accountant counts each
piece's participations separately (:attr:`BandedPlan.segment`), since a resumed run draws a new partition.
"""

from __future__ import annotations

import dataclasses
import math

from lightning_dp.accounting.banded_mf import BandedMFAccountant, BandedMFEvent, band_and_max_column_norm
from lightning_dp.correlated_noise.optimize import optimize_banded
from lightning_dp.correlated_noise.strategies import BandedToeplitz
from lightning_dp.correlated_noise.streaming import BandedNoise
from lightning_dp.data.cyclic_poisson import group_sample_rate
from lightning_dp.mechanisms.calibration_banded import calibrate_banded_mf_noise
from lightning_dp.mechanisms.gaussian import GaussianMechanism


@dataclasses.dataclass(frozen=True)
class BandedPlan:
    """The banded-MF set-up of one start of training.

    Attributes:
        strategy: ``C``, ``b``-banded lower-triangular Toeplitz with ``c_0 = 1``.
        planned_steps: ``n``, the steps ``C`` was sized for (the run's planned steps).
        column_norm: ``s``, the largest column norm of the ``n x n`` ``C``.
        group_rate: ``q_b = b q``.
        segment: the number of this start of training's segment (module docstring).
    """

    strategy: BandedToeplitz
    planned_steps: int
    column_norm: float
    group_rate: float
    segment: int

    @property
    def band(self) -> int:
        """``b``, the band and number of cyclic groups."""
        return self.strategy.band

    @property
    def participations(self) -> int:
        """``k = ceil(n / b)``: the most steps of the planned ``n`` one example takes part in."""
        return math.ceil(self.planned_steps / self.band)

    def event(self, noise_multiplier: float) -> BandedMFEvent:
        """One step's event for the accounted noise multiplier ``sigma`` (DP-SGD's, at rate ``q_b``)."""
        sigma = noise_multiplier * self.column_norm
        return BandedMFEvent(sigma, self.group_rate, self.band, self.column_norm, self.segment)

    def sum_mechanism(self, mechanism: GaussianMechanism) -> GaussianMechanism:
        """The draw ``Z_t`` is scaled to: ``N(0, (sigma s C_clip)^2)`` (the mechanism itself when ``s = 1``)."""
        if self.column_norm == 1.0:
            return mechanism
        return GaussianMechanism(mechanism.noise_multiplier * self.column_norm, mechanism.max_grad_norm)

    def noise_stream(self) -> BandedNoise:
        """A fresh streaming ``C^{-1}`` (empty state): one per optimizer, never checkpointed."""
        return BandedNoise(self.strategy)

    def calibrate(self, *, target_epsilon: float, target_delta: float, max_grad_norm: float) -> GaussianMechanism:
        """The Gaussian mechanism whose ``n`` steps reach ``target_epsilon`` under the ``banded-mf`` accountant
        (:func:`~lightning_dp.mechanisms.calibration_banded.calibrate_banded_mf_noise`; within 0.1 % below the target).

        Raises:
            ValueError: a target no noise reaches.
        """
        sigma, _ = calibrate_banded_mf_noise(
            self.strategy,
            steps=self.planned_steps,
            group_sample_rate=self.group_rate,
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            num_groups=self.band,
        )
        return GaussianMechanism(sigma / self.column_norm, max_grad_norm)

    def epsilon(self, noise_multiplier: float, delta: float, steps: int | None = None) -> float:
        """Epsilon at ``delta`` after ``steps`` steps of this segment (default: the ``n`` planned) at the accounted
        noise multiplier ``sigma``: the ``banded-mf`` accountant over :meth:`event`, as the run's ledger composes it.

        Raises:
            ValueError: ``delta`` outside ``(0, 1)``, ``steps < 1`` or a negative ``noise_multiplier``.
        """
        if steps is not None and steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        accountant = BandedMFAccountant().compose(self.event(noise_multiplier), steps or self.planned_steps)
        return accountant.get_epsilon(delta)

    def describe(self) -> str:
        """One line for the start-up block: ``b``, ``q_b``, ``k``, ``s`` and the segment."""
        restart = f"; segment {self.segment} (the correlation restarted)" if self.segment else ""
        return (
            f"banded, b = {self.band} cyclic groups, q_b = b q = {self.group_rate:.4g}, k = ceil(n / b) = "
            f"{self.participations} participations of n = {self.planned_steps}, column norm s = "
            f"{self.column_norm:.4g} (noise sigma C s (C^-1 Z)_t){restart}"
        )


def plan_banded(
    *,
    band: int,
    sample_rate: float,
    planned_steps: int | None,
    restored_coefs: tuple[float, ...] | None,
    segment: int,
) -> BandedPlan:
    """The :class:`BandedPlan` of a start of training.

    Args:
        band: ``b >= 1``.
        sample_rate: the nominal rate ``q``.
        planned_steps: ``n`` (``None``: unbounded, refused).
        restored_coefs: a checkpoint's coefficients (kept on resume), or ``None`` to optimise ``C`` for ``n``.
        segment: the segment's number.

    Raises:
        ValueError: no planned steps, a band above them, ``b q > 1``, or restored coefficients of another band.
    """
    if planned_steps is None:
        raise ValueError(
            "noise_correlation='banded' sizes its strategy for the planned steps: set max_steps or max_epochs"
        )
    if band > planned_steps:
        raise ValueError(
            f"correlation_band={band} exceeds the {planned_steps} planned steps; use a band <= {planned_steps}"
        )
    rate = group_sample_rate(band, sample_rate)
    if restored_coefs is None:
        strategy = optimize_banded(planned_steps, band, max_participations=1)
    else:
        strategy = BandedToeplitz(tuple(restored_coefs))
        if strategy.band != band:
            raise ValueError(
                f"The checkpoint was trained with correlation_band={strategy.band}, this run asks for {band}; resume "
                "with the same band"
            )
    _, column_norm = band_and_max_column_norm(strategy, planned_steps)
    return BandedPlan(strategy, planned_steps, column_norm, rate, segment)
