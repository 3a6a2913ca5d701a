"""Correlated noise as a training option (``noise_correlation='banded'`` or ``'blt'``): the run's strategy, the scale
of its noise, its privacy event and its noise stream (docs/design.md section 5.1). :class:`CorrelationPlan` is what
the engine uses; :class:`BandedPlan` and :class:`BLTPlan` are its two kinds, built by :func:`plan_correlation`.

**Banded** (:class:`BandedPlan`), with band ``b``, nominal rate ``q`` and ``n`` planned steps:

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

**BLT** (:class:`BLTPlan`), with ``d`` buffers: the data are cyclically sampled over ``b = floor(1 / q)`` groups at
``q_b = b q`` (so each example takes part at most once every ``b`` steps, about once per pass over the data); ``C`` is
:func:`~lightning_dp.correlated_noise.optimize_blt` ``(n, d, min_sep=b)``; the noise of step ``t`` is
``sigma C_clip s (C^{-1} Z)_t`` with ``s = sens(C) / sqrt(k)``, ``sens`` the ``b``-min-separation sensitivity of the
``n x n`` ``C`` and ``k = ceil(n / b)``; one step's event is
:class:`~lightning_dp.accounting.blt_minsep.BLTMinSepEvent` ``(sigma s, b, C, segment)``, so the ``blt-minsep``
accountant reports the Gaussian mechanism ``sigma / sqrt(k)`` for the planned run: ``k`` unamplified DP-SGD steps at
noise multiplier ``sigma`` (no amplification by the sampling is credited). Segments as for banded.
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import math
from typing import Any, ClassVar

from lightning_dp.accounting.banded_mf import BandedMFAccountant, BandedMFEvent, band_and_max_column_norm
from lightning_dp.accounting.base import Accountant
from lightning_dp.accounting.blt_minsep import BLTMinSepAccountant, BLTMinSepEvent, blt_sensitivity
from lightning_dp.correlated_noise.optimize import optimize_banded, optimize_blt
from lightning_dp.correlated_noise.sensitivity import participation_count
from lightning_dp.correlated_noise.strategies import BandedToeplitz, BufferedToeplitz
from lightning_dp.correlated_noise.streaming import BandedNoise, BLTNoise, CorrelatedNoise
from lightning_dp.correlated_noise.workloads import Workload
from lightning_dp.data.cyclic_poisson import blt_num_groups, group_sample_rate
from lightning_dp.mechanisms.calibration_banded import calibrate_banded_mf_noise
from lightning_dp.mechanisms.gaussian import GaussianMechanism
from lightning_dp.mechanisms.solver import closed_form_noise_ratio, solve_monotone

log = logging.getLogger("lightning_dp")


class CorrelationPlan(abc.ABC):
    """The correlated-noise set-up of one start of training: a kind's strategy, scale, event and stream.

    Every kind has ``planned_steps`` (``n``, the steps ``C`` was sized for), ``group_rate`` (``q_b = b q``),
    ``segment`` (the number of this start of training's segment, module docstring) and ``workload`` (what ``C`` was
    optimised for, :func:`~lightning_dp.engine.workload.training_workload`; ``None``: prefix sums, or a strategy
    restored from a checkpoint), and the properties below.
    """

    kind: ClassVar[str]
    planned_steps: int
    group_rate: float
    segment: int
    workload: Workload | None

    def _workload(self) -> str:
        """The start-up block's words for the workload ``C`` was optimised for ("" for prefix sums)."""
        workload = self.workload
        if workload is None:
            return ""
        momentum = [f"SGD momentum {workload.momentum:g}"] if workload.momentum else []
        schedule = [] if workload.is_toeplitz else ["the learning-rate schedule"]
        return f", optimised for {' and '.join(momentum + schedule)}"

    @property
    @abc.abstractmethod
    def num_groups(self) -> int:
        """``b``, the cyclic groups of the sampler (the minimum separation of one example's steps)."""

    @property
    @abc.abstractmethod
    def scale(self) -> float:
        """``s``: the noise on ``C x`` is ``sigma s C_clip`` for the accounted noise multiplier ``sigma``."""

    @property
    def participations(self) -> int:
        """``k = ceil(n / b)``: the most steps of the planned ``n`` one example takes part in."""
        return math.ceil(self.planned_steps / self.num_groups)

    @abc.abstractmethod
    def event(self, noise_multiplier: float) -> Any:
        """One step's event for the accounted noise multiplier ``sigma``."""

    @abc.abstractmethod
    def accountant(self) -> Accountant:
        """An empty accountant of this kind's events."""

    @abc.abstractmethod
    def noise_stream(self) -> CorrelatedNoise:
        """A fresh streaming ``C^{-1}`` (empty state): one per optimizer, never checkpointed."""

    @abc.abstractmethod
    def checkpoint_entry(self) -> dict[str, Any]:
        """The strategy as a checkpoint keeps it (public, like the mechanism): ``{"kind": ..., its parameters}``."""

    @abc.abstractmethod
    def summary(self) -> dict[str, Any]:
        """The privacy summary's entries of this plan."""

    @abc.abstractmethod
    def describe(self) -> str:
        """One line for the start-up block."""

    def sum_mechanism(self, mechanism: GaussianMechanism) -> GaussianMechanism:
        """The draw ``Z_t`` is scaled to: ``N(0, (sigma s C_clip)^2)`` (the mechanism itself when ``s = 1``)."""
        if self.scale == 1.0:
            return mechanism
        return GaussianMechanism(mechanism.noise_multiplier * self.scale, mechanism.max_grad_norm)

    def epsilon(self, noise_multiplier: float, delta: float, steps: int | None = None) -> float:
        """Epsilon at ``delta`` after ``steps`` steps of this segment (default: the ``n`` planned) at the accounted
        noise multiplier ``sigma``: this kind's accountant over :meth:`event`, as the run's ledger composes it.

        Raises:
            ValueError: ``delta`` outside ``(0, 1)``, ``steps < 1`` or a negative ``noise_multiplier``.
        """
        if steps is not None and steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        accountant = self.accountant().compose(self.event(noise_multiplier), steps or self.planned_steps)
        return accountant.get_epsilon(delta)

    def calibrate(self, *, target_epsilon: float, target_delta: float, max_grad_norm: float) -> GaussianMechanism:
        """The Gaussian mechanism whose ``n`` steps reach ``target_epsilon`` under this kind's accountant (within
        0.1 % below the target, :func:`~lightning_dp.mechanisms.solver.solve_monotone`, started from the closed form
        of ``k`` unsubsampled steps).

        Raises:
            ValueError: a target no noise reaches.
        """
        ratio = closed_form_noise_ratio(target_epsilon, target_delta, 1.0, self.participations)
        sigma, _ = solve_monotone(
            lambda sigma: self.epsilon(sigma, target_delta),
            target_epsilon,
            initial=max(ratio, 0.3),
            increasing=False,
            bounds=(1e-3, 1e4),
        )
        return GaussianMechanism(sigma, max_grad_norm)


@dataclasses.dataclass(frozen=True)
class BandedPlan(CorrelationPlan):
    """The banded-MF set-up of one start of training.

    Attributes:
        strategy: ``C``, ``b``-banded lower-triangular Toeplitz with ``c_0 = 1``.
        planned_steps: ``n``, the steps ``C`` was sized for (the run's planned steps).
        column_norm: ``s``, the largest column norm of the ``n x n`` ``C``.
        group_rate: ``q_b = b q``.
        segment: the number of this start of training's segment (module docstring).
    """

    kind: ClassVar[str] = "banded"
    strategy: BandedToeplitz
    planned_steps: int
    column_norm: float
    group_rate: float
    segment: int
    workload: Workload | None = None

    @property
    def band(self) -> int:
        """``b``, the band and number of cyclic groups."""
        return self.strategy.band

    @property
    def num_groups(self) -> int:
        return self.strategy.band

    @property
    def scale(self) -> float:
        return self.column_norm

    def event(self, noise_multiplier: float) -> BandedMFEvent:
        """One step's event for the accounted noise multiplier ``sigma`` (DP-SGD's, at rate ``q_b``)."""
        sigma = noise_multiplier * self.column_norm
        return BandedMFEvent(sigma, self.group_rate, self.band, self.column_norm, self.segment)

    def accountant(self) -> BandedMFAccountant:
        return BandedMFAccountant()

    def noise_stream(self) -> BandedNoise:
        return BandedNoise(self.strategy)

    def checkpoint_entry(self) -> dict[str, Any]:
        return {"kind": "banded", "coefs": list(self.strategy.coefs)}

    def summary(self) -> dict[str, Any]:
        return {
            "noise_correlation": "banded",
            "correlation_band": self.band,
            "group_sample_rate": self.group_rate,
            "max_column_norm": self.column_norm,
        }

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

    def describe(self) -> str:
        """``b``, ``q_b``, ``k``, ``s`` and the segment."""
        restart = f"; segment {self.segment} (the correlation restarted)" if self.segment else ""
        return (
            f"banded, b = {self.band} cyclic groups, q_b = b q = {self.group_rate:.4g}, k = ceil(n / b) = "
            f"{self.participations} participations of n = {self.planned_steps}, column norm s = "
            f"{self.column_norm:.4g} (noise sigma C s (C^-1 Z)_t){self._workload()}{restart}"
        )


@dataclasses.dataclass(frozen=True)
class BLTPlan(CorrelationPlan):
    """The BLT set-up of one start of training (module docstring).

    Attributes:
        strategy: ``C``, a BLT with ``d`` buffers.
        planned_steps: ``n``.
        groups: ``b = floor(1 / q)``, the cyclic groups (the minimum separation).
        sensitivity: ``sens(C)`` of the ``n x n`` ``C`` under ``b``-min-separation (clip norm 1).
        noise_scale: ``s = sens(C) / sqrt(k)`` of the first start of training's ``n`` (kept on resume, so that the
            noise on ``C x``, ``sigma s``, stays the ledger's): ``sigma`` is then the noise multiplier of ``k``
            unamplified DP-SGD steps.
        group_rate: ``q_b = b q``.
        segment: the number of this start of training's segment.
    """

    kind: ClassVar[str] = "blt"
    strategy: BufferedToeplitz
    planned_steps: int
    groups: int
    sensitivity: float
    noise_scale: float
    group_rate: float
    segment: int
    workload: Workload | None = None

    @property
    def num_groups(self) -> int:
        return self.groups

    @property
    def scale(self) -> float:
        return self.noise_scale

    def event(self, noise_multiplier: float) -> BLTMinSepEvent:
        """One step's event for the accounted noise multiplier ``sigma`` (noise ``sigma s`` on ``C x``)."""
        strategy = self.strategy
        return BLTMinSepEvent(
            noise_multiplier * self.scale, self.groups, strategy.decays, strategy.scales, self.segment
        )

    def accountant(self) -> BLTMinSepAccountant:
        return BLTMinSepAccountant()

    def noise_stream(self) -> BLTNoise:
        return BLTNoise(self.strategy)

    def checkpoint_entry(self) -> dict[str, Any]:
        strategy = self.strategy
        return {
            "kind": "blt",
            "decays": list(strategy.decays),
            "scales": list(strategy.scales),
            "noise_scale": self.scale,
        }

    def summary(self) -> dict[str, Any]:
        return {
            "noise_correlation": "blt",
            "correlation_buffers": self.strategy.num_buffers,
            "num_groups": self.groups,
            "group_sample_rate": self.group_rate,
            "noise_scale": self.scale,
        }

    def describe(self) -> str:
        """``d``, ``b``, ``q_b``, ``k``, ``sens``, ``s`` and the segment."""
        restart = f"; segment {self.segment} (the correlation restarted)" if self.segment else ""
        scale = "kept from the first segment" if self.segment else "sens / sqrt(k)"
        return (
            f"blt, d = {self.strategy.num_buffers} buffers, b = floor(1 / q) = {self.groups} cyclic groups, q_b = "
            f"{self.group_rate:.4g}, k = ceil(n / b) = {self.participations} participations of n = "
            f"{self.planned_steps}, sensitivity {self.sensitivity:.4g} (b-min-separation, no amplification credited; "
            f"noise sigma C s (C^-1 Z)_t, s = {scale} = {self.scale:.4g}){self._workload()}{restart}"
        )


def plan_correlation(
    kind: str,
    *,
    band: int | None,
    buffers: int | None,
    sample_rate: float,
    planned_steps: int | None,
    restored: dict[str, Any] | None,
    segment: int,
    workload: Workload | None = None,
) -> BandedPlan | BLTPlan:
    """The :class:`CorrelationPlan` of a start of training.

    Args:
        kind: ``"banded"`` or ``"blt"``.
        band: ``b >= 1`` (banded).
        buffers: ``d >= 1`` (BLT).
        sample_rate: the nominal rate ``q``.
        planned_steps: ``n`` (``None``: unbounded, refused).
        restored: the checkpoint's strategy (:meth:`CorrelationPlan.checkpoint_entry`, kept on resume), or ``None``
            to optimise ``C`` for ``n``.
        segment: the segment's number.
        workload: optimise a new ``C`` for this workload of ``n`` steps
            (:func:`~lightning_dp.engine.workload.training_workload`; ``None``: prefix sums).

    Raises:
        ValueError: no planned steps, a band (banded) or ``floor(1 / q)`` (BLT) above them, ``b q > 1``, or a restored
            strategy of another band or number of buffers.
    """
    if planned_steps is None:
        raise ValueError(
            f"noise_correlation={kind!r} sizes its strategy for the planned steps: set max_steps or max_epochs"
        )
    if kind == "banded":
        assert band is not None  # PrivacyConfig requires it
        return _plan_banded(band, sample_rate, planned_steps, restored, segment, workload)
    assert buffers is not None  # PrivacyConfig's default
    return _plan_blt(buffers, sample_rate, planned_steps, restored, segment, workload)


def _plan_banded(
    band: int,
    sample_rate: float,
    planned_steps: int,
    restored: dict[str, Any] | None,
    segment: int,
    workload: Workload | None,
) -> BandedPlan:
    if band > planned_steps:
        raise ValueError(
            f"correlation_band={band} exceeds the {planned_steps} planned steps; use a band <= {planned_steps}"
        )
    rate = group_sample_rate(band, sample_rate)
    if restored is None:
        strategy = optimize_banded(planned_steps, band, max_participations=1, workload=workload)
    else:
        workload = None
        strategy = BandedToeplitz(tuple(restored["coefs"]))
        if strategy.band != band:
            raise ValueError(
                f"The checkpoint was trained with correlation_band={strategy.band}, this run asks for {band}; resume "
                "with the same band"
            )
    _, column_norm = band_and_max_column_norm(strategy, planned_steps)
    return BandedPlan(strategy, planned_steps, column_norm, rate, segment, workload)


def _plan_blt(
    buffers: int,
    sample_rate: float,
    planned_steps: int,
    restored: dict[str, Any] | None,
    segment: int,
    workload: Workload | None,
) -> BLTPlan:
    groups = blt_num_groups(sample_rate)
    if groups > planned_steps:
        raise ValueError(
            f"noise_correlation='blt' samples each example once every b = floor(1 / q) = {groups} steps, more than the "
            f"{planned_steps} planned: most examples would never be used; train for at least {groups} steps or use a "
            "larger expected batch"
        )
    if groups == 1 and sample_rate < 1.0:
        log.warning(
            "noise_correlation='blt' at q = %.4g > 1/2 has one cyclic group (b = 1): every step may use every example "
            "and no amplification by sampling is credited, so its epsilon is likely above DP-SGD's "
            "(noise_correlation=None); use a smaller expected batch",
            sample_rate,
        )
    k = participation_count(planned_steps, groups)
    if restored is None:
        strategy = optimize_blt(planned_steps, buffers, min_sep=groups, workload=workload)
    else:
        workload = None
        strategy = BufferedToeplitz(tuple(restored["decays"]), tuple(restored["scales"]))
        if strategy.num_buffers != buffers:
            raise ValueError(
                f"The checkpoint was trained with correlation_buffers={strategy.num_buffers}, this run asks for "
                f"{buffers}; resume with the same number of buffers"
            )
    sensitivity = blt_sensitivity(strategy, planned_steps, groups)
    scale = sensitivity / math.sqrt(k) if restored is None else float(restored["noise_scale"])
    rate = group_sample_rate(groups, sample_rate)
    return BLTPlan(strategy, planned_steps, groups, sensitivity, scale, rate, segment, workload)
