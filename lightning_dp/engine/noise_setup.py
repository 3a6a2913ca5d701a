"""Fixing a run's privacy parameters once its data is known: delta, the noise (calibrated for ``target_epsilon`` when
asked) and the accountant."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable
from typing import Any

from lightning_dp.accounting import make_accountant
from lightning_dp.accounting.banded_mf import BandedMFEvent
from lightning_dp.accounting.blt_minsep import BLTMinSepEvent
from lightning_dp.correlated_noise.kinds import CORRELATION_ACCOUNTANTS, DEFAULT_BLT_BUFFERS
from lightning_dp.correlated_noise.workloads import Workload
from lightning_dp.engine.accounting import PrivacyLedger
from lightning_dp.engine.clip_bound import ClipBound
from lightning_dp.engine.correlation import BandedPlan, BLTPlan, plan_correlation
from lightning_dp.engine.exact_resume import continues_segment
from lightning_dp.engine.run_state import RunState
from lightning_dp.mechanisms import NoiseMechanism, calibrate_randomized_clipping, make_mechanism
from lightning_dp.mechanisms.base import mechanism_class
from lightning_dp.mechanisms.gaussian import GaussianMechanism

log = logging.getLogger("lightning_dp")


def default_delta(num_samples: int) -> float:
    """``1 / N^1.1`` (docs/design.md section 3.1): below ``1/N`` by a margin that grows with N."""
    return 1.0 / num_samples**1.1


class NoiseSetup:
    """Fixes delta, the mechanism and the accountant in the run's :class:`~lightning_dp.engine.run_state.RunState`;
    checks the accountant with the step event of its :class:`~lightning_dp.engine.accounting.PrivacyLedger`."""

    def __init__(self, state: RunState, ledger: PrivacyLedger, clip_bound: ClipBound) -> None:
        self.state = state
        self.ledger = ledger
        self.clip_bound = clip_bound

    def prepare(
        self, *, num_samples: int, sample_rate: float, total_steps: int | None, workload: Workload | None = None
    ) -> None:
        """Fix the sampling rate, delta, mechanism (calibrated if needed) and accountant; applied defaults join
        ``state.defaults_applied``.

        Args:
            num_samples: dataset size N (default delta; a warning when delta >= 1/N).
            sample_rate: Poisson rate q of one logical step.
            total_steps: planned logical steps (needed only to calibrate for ``target_epsilon``; ``None``: unbounded).
            workload: with correlated noise, the workload of the ``total_steps`` its strategy is optimised for
                (:func:`~lightning_dp.engine.workload.training_workload`; ``None``: prefix sums).

        Raises:
            RuntimeError: before the clipping hooks are attached; correlated noise before the training loader (its
                cyclic sampler) is built.
            ValueError: calibration needed without ``total_steps``; a sample rate differing from a restored
                checkpoint's.
        """
        state, config = self.state, self.state.config
        if state.num_params is None:
            raise RuntimeError("attach(module) must run before prepare()")
        if config.noise_correlation is not None and state.partitioned_dataset is None:
            raise RuntimeError(
                f"noise_correlation={config.noise_correlation!r} is accounted for the run's cyclic sampler: build the "
                "training loader with training_loader() before prepare()"
            )
        if state.restored_sample_rate is not None and not math.isclose(state.restored_sample_rate, sample_rate):
            raise ValueError(
                f"The checkpoint was trained with sample_rate={state.restored_sample_rate}, this run uses "
                f"{sample_rate}; resume with the same data and batch size"
            )
        state.num_samples, state.sample_rate = int(num_samples), float(sample_rate)
        if state.target_delta is None:
            state.target_delta = default_delta(num_samples)
            state.defaults_applied.append(f"target_delta = 1/N^1.1 = {state.target_delta:.3g} for N = {num_samples}")
        if state.target_delta >= 1.0 / num_samples:
            log.warning(
                "target_delta = %.3g is not below 1/N = %.3g: such a delta allows releasing a whole example",
                state.target_delta,
                1.0 / num_samples,
            )
        if state.accountant is None and config.accountant is None:
            state.defaults_applied.append(
                f"accountant = {self.default_accountant()!r} (the sound default for {config.noise_name}"
                + (
                    f", noise_correlation={config.noise_correlation!r})"
                    if config.noise_correlation is not None
                    else ")"
                )
            )
        if state.auto_clipping is not None and state.auto_clipping not in state.defaults_applied:
            state.defaults_applied.append(state.auto_clipping)
        # a noise already fixed beside a target (which excludes a given noise): a checkpoint's, kept on resume
        kept_for_target = state.mechanism is not None and config.target_epsilon is not None
        if config.noise_correlation is not None:
            buffers = config.correlation_buffers
            if config.noise_correlation == "blt" and buffers is None:
                buffers = DEFAULT_BLT_BUFFERS
                if state.correlation is None:
                    state.defaults_applied.append(f"correlation_buffers = {buffers} (noise_correlation='blt')")
            # a checkpoint's strategy on resume; on a second fit of the same run, the first fit's: sigma, b and C stay
            # those the ledger holds (the accountant refuses a change)
            kept = state.correlation.checkpoint_entry() if state.correlation is not None else state.restored_correlation
            plan = functools.partial(
                plan_correlation,
                config.noise_correlation,
                band=config.correlation_band,
                buffers=buffers,
                sample_rate=float(sample_rate),
                planned_steps=total_steps,
                segment=self._next_segment(),
                workload=workload,
            )
            state.correlation = self._rank_zeros_plan(plan, kept)
        if state.mechanism is None:
            state.mechanism = self._rank_zeros_noise(self._calibrate(total_steps))
        if state.accountant is None:
            state.accountant = make_accountant(config.accountant or self.default_accountant())
        self._check_accountant_supports()
        if kept_for_target:
            self._report_unused_target(total_steps)
        state.sum_mechanism = self.clip_bound.setup_adaptive() if config.adaptive_clipping else state.mechanism
        if state.correlation is not None:
            if not isinstance(state.mechanism, GaussianMechanism):
                raise ValueError(
                    f"noise_correlation={config.noise_correlation!r} correlates the built-in Gaussian noise, not "
                    f"{type(state.mechanism)}"
                )
            state.sum_mechanism = state.correlation.sum_mechanism(state.mechanism)
            if state.accountant.ledger:  # refused now, before a step is applied, not when the step is recorded
                state.accountant.copy().compose(self.ledger.step_event())

    def _rank_zeros_plan(
        self, plan: Callable[..., BandedPlan | BLTPlan], kept: dict[str, Any] | None
    ) -> BandedPlan | BLTPlan:
        """``plan(restored=kept)``; for a newly optimised ``C`` on several processes, rank 0's: each rank optimises it,
        then adopts rank 0's coefficients (optimisers on different machines can differ in the last bits, and the ranks
        must add the same noise)."""
        planned = plan(restored=kept)
        distributed = self.state.distributed
        if kept is not None or distributed is None:
            return planned
        distributed.check_identical(
            "noise correlation, its groups, planned steps and group sample rate",
            (planned.kind, planned.num_groups, planned.planned_steps, planned.group_rate),
        )
        entry = distributed.broadcast_object(planned.checkpoint_entry())
        if entry == planned.checkpoint_entry():
            return planned
        return dataclasses.replace(plan(restored=entry), workload=planned.workload)

    def _rank_zeros_noise(self, mechanism: NoiseMechanism) -> NoiseMechanism:
        """On several processes, rank 0's calibrated noise parameters on every rank (a calibration's last bits can
        differ between machines, and the ranks must add the same noise and account for it alike)."""
        distributed = self.state.distributed
        if distributed is None:
            return mechanism
        params = distributed.broadcast_object(mechanism.describe())
        return mechanism if params == mechanism.describe() else make_mechanism(mechanism.name, **params)

    def _next_segment(self) -> int:
        """The segment of this start of training: 0 on a fresh ledger, the last one when an exact resume continues
        its streams, else one more than its last correlated step's (a resume or a second ``fit`` restarts the
        correlation; docs/design.md section 5.1)."""
        ledger = self.state.accountant.ledger if self.state.accountant is not None else []
        segments = [event.segment for event, _ in ledger if isinstance(event, BandedMFEvent | BLTMinSepEvent)]
        return segments[-1] + (0 if continues_segment(self.state) else 1) if segments else 0

    def default_accountant(self) -> str:
        """``"rc"`` for randomized clipping, ``"banded-mf"`` / ``"blt-minsep"`` for correlated noise, else the
        mechanism's sound default."""
        if self.state.config.noise_correlation is not None:
            return CORRELATION_ACCOUNTANTS[self.state.config.noise_correlation]
        mechanism = self.state.mechanism or mechanism_class(self.state.config.noise_name)
        return "rc" if self.state.randomized_clipping else mechanism.default_accountant

    def _calibrate(self, total_steps: int | None) -> NoiseMechanism:
        """The mechanism calibrated for ``target_epsilon`` over ``total_steps`` steps."""
        from lightning_dp.mechanisms.calibration import calibrate

        state, config = self.state, self.state.config
        if total_steps is None:
            raise ValueError(
                "target_epsilon needs a finite number of steps to calibrate the noise for: set max_epochs or "
                "max_steps, or give the noise (noise_multiplier / noise_params) and use PrivacyBudget to stop"
            )
        assert config.target_epsilon is not None and state.target_delta is not None and state.sample_rate is not None
        mechanism: NoiseMechanism
        if state.correlation is not None:
            mechanism = state.correlation.calibrate(
                target_epsilon=config.target_epsilon,
                target_delta=state.target_delta,
                max_grad_norm=state.max_grad_norm,
            )
        elif state.randomized_clipping:
            assert state.clipper is not None and state.norm_dim is not None
            engine = state.clipper.engine
            assert engine.estimator is not None  # register_engine refuses a randomized engine without one
            mechanism = calibrate_randomized_clipping(
                target_epsilon=config.target_epsilon,
                target_delta=state.target_delta,
                sample_rate=state.sample_rate,
                steps=total_steps,
                projection_dim=engine.projection_dim,
                norm_dim=state.norm_dim,
                estimator=engine.estimator,
                max_grad_norm=state.max_grad_norm,
            ).mechanism
        else:
            mechanism = calibrate(
                config.noise_name,
                target_epsilon=config.target_epsilon,
                target_delta=state.target_delta,
                sample_rate=state.sample_rate,
                steps=total_steps,
                max_grad_norm=state.max_grad_norm,
                num_params=state.num_params,
                accountant=config.accountant,
            )
        state.noise_origin = f"calibrated for epsilon={config.target_epsilon:.4g} over {total_steps} steps"
        return mechanism

    def _report_unused_target(self, total_steps: int | None) -> None:
        """Say in the noise's origin (the start-up block) that a resume kept the checkpoint's noise, so that
        ``target_epsilon`` was not used, and what epsilon the planned steps reach with that noise; warn when it is
        above the target."""
        state, target = self.state, self.state.config.target_epsilon
        assert state.accountant is not None and state.target_delta is not None and target is not None
        if total_steps is None:
            reach = "no planned number of steps (PrivacyBudget stops at the target)"
        else:
            more = max(0, total_steps - state.steps)
            epsilon = state.accountant.copy().compose(self.ledger.step_event(), more).get_epsilon(state.target_delta)
            reach = f"the {total_steps} planned steps reach epsilon={epsilon:.4g}"
            if epsilon > target:
                log.warning(
                    "Resumed with the checkpoint's noise, calibrated for its own plan: the %d planned steps reach "
                    "epsilon=%.4g, above target_epsilon=%g. Plan fewer steps, or add PrivacyBudget to stop at the "
                    "target",
                    total_steps,
                    epsilon,
                    target,
                )
        state.noise_origin = f"{state.noise_origin}; target_epsilon={target:g} not used, {reach}"

    def _check_accountant_supports(self) -> None:
        state = self.state
        assert state.accountant is not None and state.mechanism is not None
        if not state.accountant.supports(self.ledger.step_event()):
            raise ValueError(
                f"Accountant {state.accountant.name!r} cannot account for {state.mechanism.name!r} noise; "
                f"use accountant={self.default_accountant()!r}"
            )
