"""PrivacyEngine: the framework-agnostic DP state of one training run.

It owns the noise mechanism (calibrated for a target epsilon when asked), the per-sample clipper attached to the
model, the dedicated noise and sampling generators, and the accountant's ledger. The Lightning strategy (and the
HF integration) only call it; nothing here knows about a trainer.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_dp.accounting import Accountant, make_accountant
from lightning_dp.checks.guard import TrainingGuard
from lightning_dp.clipping import PerSampleClipper
from lightning_dp.clipping.groups import ClippingGroups
from lightning_dp.clipping.hutch import norm_dim
from lightning_dp.config import PrivacyConfig, option_docs
from lightning_dp.engine.accounting import EngineAccounting
from lightning_dp.engine.checkpoint import EngineCheckpoint
from lightning_dp.engine.startup import EngineStartup
from lightning_dp.engine.steps import EngineSteps
from lightning_dp.mechanisms import NoiseMechanism, calibrate_randomized_clipping, make_mechanism
from lightning_dp.mechanisms.base import mechanism_class
from lightning_dp.mechanisms.gaussian import GaussianMechanism
from lightning_dp.mechanisms.secure import secure_sample
from lightning_dp.optim import DPOptimizer, DPRandomness, make_lowpass
from lightning_dp.optim.adaptive_clipping import DEFAULT_COUNT_NOISE_FRACTION, AdaptiveClipping, sum_noise_multiplier
from lightning_dp.optim.momentum import PerSampleMomentum

log = logging.getLogger("lightning_dp")


def default_delta(num_samples: int) -> float:
    """``1 / N^1.1`` (docs/design.md section 3.1): below ``1/N`` by a margin that grows with N."""
    return 1.0 / num_samples**1.1


class PrivacyEngine(EngineSteps, EngineAccounting, EngineCheckpoint, EngineStartup):
    """Configuration and state of differentially private training.

    Exactly one of ``target_epsilon`` (the noise is calibrated for the planned number of steps) and
    ``noise_multiplier`` (Gaussian) / ``noise_params`` (other mechanisms) / a ready ``NoiseMechanism`` must fix
    the noise.

    Args:
        config: the run's options (:class:`~lightning_dp.config.PrivacyConfig`); or give them as keyword arguments
            instead, ``PrivacyEngine(max_grad_norm=1.0, noise_multiplier=1.1)``.
        options: the fields of :class:`~lightning_dp.config.PrivacyConfig`, when ``config`` is not given:
            {options}

    Raises:
        ValueError: any invalid option or combination (see :class:`~lightning_dp.config.PrivacyConfig`), with what
            to change; both ``config`` and keyword options.
    """

    def __init__(self, config: PrivacyConfig | None = None, **options: Any) -> None:
        if config is None:
            config = PrivacyConfig(**options)
        elif options:
            raise ValueError(f"give either a PrivacyConfig or its options as keywords, not both ({sorted(options)})")
        self.config = config
        self.momentum = PerSampleMomentum(config.momentum_length, config.momentum_beta)
        self.randomized_clipping = config.randomized_clipping
        #: the sensitivity of a step's clipped sum, the mechanism's ``max_grad_norm``: the bound C, or with
        #: ``clipping_groups`` and a list of bounds ``sqrt(sum_g C_g^2)`` (``config.max_grad_norm`` keeps the list).
        self.max_grad_norm = config.sensitivity
        #: the bound the next micro-batch is clipped at: ``max_grad_norm``, or under adaptive clipping the bound it
        #: has moved to (a released value).
        self.current_max_grad_norm = self.max_grad_norm
        #: the resolved clipping groups and their bounds (set by ``attach``; ``None``: flat clipping), kept after
        #: ``detach`` for the summary.
        self.clipping_groups: ClippingGroups | None = None
        self.target_epsilon = config.target_epsilon
        #: delta of the reported epsilon: ``config.target_delta``, or its default once N is known (``prepare``).
        self.target_delta = config.target_delta
        self.noise = config.noise
        #: the clipping engine's name: ``config.clipping``, or the engine ``'auto'`` resolved to (what every report
        #: names: the start-up block, the summary, the trackers).
        self.clipping, reason = config.resolved_clipping()
        #: with ``clipping='auto'``, the engine chosen and why, for :attr:`defaults_applied` (added by ``prepare``).
        self._auto_clipping = (
            None if reason is None else f"clipping = {self.clipping!r} with book-keeping (auto: {reason})"
        )
        self.sum_check_every = config.sum_check_every
        self.projection_dim = config.projection_dim
        self.accountant_name = config.accountant
        self.check_batch_independence = bool(config.check_batch_independence)
        self.check_batch_independence_every = config.check_batch_independence_every
        self.secure_mode = bool(config.secure_mode)
        self.randomness = DPRandomness(config.seed, secure=self.secure_mode)
        #: checks around each training forward (buffers, batch independence), created by ``attach``.
        self.guard: TrainingGuard | None = None
        #: the low-pass filter applied to every noisy step, or ``None``.
        self.lowpass = make_lowpass(config.lowpass)
        #: fixed noise is built (and validated) here; with ``target_epsilon`` it is calibrated in ``prepare``.
        self.mechanism: NoiseMechanism | None = None
        if isinstance(config.noise, NoiseMechanism):
            self.mechanism = config.noise
        elif config.target_epsilon is None:
            params = dict(config.noise_params or {})
            if config.noise_multiplier is not None:
                params["noise_multiplier"] = config.noise_multiplier
            self.mechanism = make_mechanism(config.noise, max_grad_norm=self.max_grad_norm, **params)
        #: where the noise came from, for the start-up block: ``"given"``, ``"calibrated for ..."`` (``prepare``) or
        #: ``"restored from the checkpoint"`` (``load_state_dict``).
        self.noise_origin = "given" if self.mechanism is not None else None
        #: the defaults that affect the guarantee, one phrase each (``training_loader``, ``prepare``), shown by the
        #: start-up block.
        self.defaults_applied: list[str] = []
        if self.mechanism is not None and self.mechanism.is_noiseless:
            log.warning(
                "%s adds no noise (%s): no finite epsilon holds, the run is NOT differentially private and reports "
                "epsilon = inf",
                self.mechanism.name,
                self.mechanism.describe(),
            )
        self.accountant: Accountant | None = None
        self.clipper: PerSampleClipper | None = None
        self._rows_per_unit: int | None = None
        #: whether the clipper of a finished run dropped examples with a non-finite loss or gradient (set by
        #: :meth:`detach`; this process's examples only).
        self.dropped_nonfinite = False
        #: set only by the audit's test-only controls (:mod:`lightning_dp.audit.controls`): what was broken; the
        #: summary then says so, since its epsilon is false.
        self.broken_for_testing: str | None = None
        #: ``d`` of the randomized-clipping event (set by ``attach`` for hutch/hutchpp).
        self.norm_dim: int | None = None
        self.sample_rate: float | None = None
        self.num_samples: int | None = None
        self.num_params: int | None = None
        self._max_steps_cache: tuple[float, int] | None = None
        self._restored_sample_rate: float | None = None
        self._epsilon_cache: tuple[tuple[int, float, int], float] | None = None
        #: when set (by the ``PrivacyBudget`` callback), no step is taken that would push epsilon above it.
        self.epsilon_budget: float | None = None
        #: the moving clipping bound with ``target_unclipped_quantile`` (created by ``prepare``), else ``None``.
        self.adaptive: AdaptiveClipping | None = None
        #: the mechanism that noises the clipped sum: :attr:`mechanism` itself, except under adaptive clipping (the
        #: sum's share of the noise, at the current bound; ``mechanism`` is the one accounted for).
        self.sum_mechanism: NoiseMechanism | None = None
        self._restored_clip_bound: float | None = None

    # ----------------------------------------------------------------------------------------------- set-up
    @property
    def noise_name(self) -> str:
        """The mechanism's registry name."""
        return self.config.noise_name

    def attach(self, module: nn.Module) -> PerSampleClipper:
        """Attach per-sample clipping hooks to ``module`` in place (fails early on unsupported layers).

        An FSDP2-sharded ``module`` (``fully_shard`` applied before this call) is clipped exactly, its clipped sums
        reach each rank's shards and the per-sample momentum's iterates are kept as shards
        (:mod:`lightning_dp.runtime.sharding`).

        Raises:
            ValueError: unsupported layers (see :class:`PerSampleClipper`).
        """
        clip_norm = (self.mechanism or mechanism_class(self.noise_name)).clip_norm
        grouped = self.config.clipping_groups is not None
        self.clipper = PerSampleClipper(
            module,
            clipping=self.clipping,
            max_grad_norm=self.config.max_grad_norm if grouped else self.current_max_grad_norm,
            clipping_groups=self.config.clipping_groups,
            norm=clip_norm,
            sum_check_every=self.sum_check_every,
            projection_dim=self.projection_dim,
            generator_for=self.randomness.projection_generator,
            augmentation_multiplicity=self.rows_per_unit,
        )
        self.clipping_groups = self.clipper.groups
        self.momentum.bind(self.clipper)
        self.num_params = sum(p.numel() for p in self.clipper.trainable_parameters)
        self.guard = TrainingGuard(
            module,
            self.clipper.output_targets,
            check_batch_independence=self.check_batch_independence,
            check_every=self.check_batch_independence_every,
            step=lambda: self.steps,
            copies=self.rows_per_unit,
        )
        if self.randomized_clipping:
            self.norm_dim = norm_dim(self.clipper.trainable_parameters)
        return self.clipper

    @property
    def rows_per_unit(self) -> int:
        """The rows of the forward that one clipped unit owns: the ``augmentation_multiplicity`` copies of an
        example, times, with ``privacy_unit="user"``, the ``examples_per_user`` rows of a user (known once the
        training loader regrouped the data)."""
        return self._rows_per_unit or self.config.augmentation_multiplicity

    def set_rows_per_unit(self, rows: int) -> None:
        """Make the clipper and the checks fold ``rows`` consecutive rows of every hooked layer into one unit (a
        user's rows; :mod:`lightning_dp.clipping.multiplicity`), now and when attached later."""
        self._rows_per_unit = int(rows)
        if self.clipper is not None:
            self.clipper.augmentation_multiplicity = self._rows_per_unit
        if self.guard is not None:
            self.guard.copies = self._rows_per_unit

    def detach(self) -> None:
        """Remove the clipping hooks; the module is exactly as before ``attach``. Whether the clipper dropped
        examples with a non-finite loss or gradient is kept in :attr:`dropped_nonfinite` (this process only)."""
        if self.clipper is not None:
            self.dropped_nonfinite |= self.clipper.dropped_nonfinite
            self.clipper.detach()
            self.clipper = None
        self.guard = None
        self.distributed = None  # the run is over: a later restore must not reach for its process group

    def add_past_iterates(self, compute_loss: Callable[[], torch.Tensor | None], *, stand_in: bool = False) -> None:
        """Per-sample momentum: run ``compute_loss`` at each stored iterate and keep its weighted per-sample terms
        for the next ``clipper.backward(loss, weight=self.momentum.current_weight)`` (nothing when
        ``momentum_length = 1``).

        Call once per (micro-)batch BEFORE the current forward, with a ``compute_loss`` that re-runs the user's
        forward and per-sample loss on that batch (``() -> [B]``, or ``None`` to skip the batch); with ``stand_in``
        for a stand-in batch (weight 0). See :meth:`~lightning_dp.optim.momentum.PerSampleMomentum.add_past_iterates`.

        Raises:
            RuntimeError: before :meth:`attach`.
        """
        if self.clipper is None:
            raise RuntimeError("attach(module) must run before add_past_iterates()")
        self.momentum.add_past_iterates(self.clipper, compute_loss, stand_in=stand_in)

    def prepare(self, *, num_samples: int, sample_rate: float, total_steps: int | None) -> None:
        """Fix the sampling rate, delta, mechanism (calibrating it if needed) and accountant; the defaults it applies
        join :attr:`defaults_applied` (shown by :meth:`startup_lines`).

        Args:
            num_samples: dataset size N (for the default delta and a warning when delta >= 1/N).
            sample_rate: Poisson rate q of one logical step.
            total_steps: planned logical steps of the whole run (needed only to calibrate for ``target_epsilon``;
                ``None`` when unbounded).

        Raises:
            ValueError: calibration needed but ``total_steps`` is None; the sample rate differs from a restored
                checkpoint's.
        """
        if self.num_params is None:
            raise RuntimeError("attach(module) must run before prepare()")
        if self._restored_sample_rate is not None and not math.isclose(self._restored_sample_rate, sample_rate):
            raise ValueError(
                f"The checkpoint was trained with sample_rate={self._restored_sample_rate}, this run uses "
                f"{sample_rate}; resume with the same data and batch size"
            )
        self.num_samples, self.sample_rate = int(num_samples), float(sample_rate)
        if self.target_delta is None:
            self.target_delta = default_delta(num_samples)
            self.defaults_applied.append(f"target_delta = 1/N^1.1 = {self.target_delta:.3g} for N = {num_samples}")
        if self.target_delta >= 1.0 / num_samples:
            log.warning(
                "target_delta = %.3g is not below 1/N = %.3g: such a delta allows releasing a whole example",
                self.target_delta,
                1.0 / num_samples,
            )
        if self.accountant is None and self.accountant_name is None:
            self.defaults_applied.append(
                f"accountant = {self._default_accountant()!r} (the sound default for {self.noise_name})"
            )
        if self._auto_clipping is not None and self._auto_clipping not in self.defaults_applied:
            self.defaults_applied.append(self._auto_clipping)
        if self.mechanism is None:
            self.mechanism = self._calibrate(total_steps)
        if self.accountant is None:
            self.accountant = make_accountant(self.accountant_name or self._default_accountant())
        self._check_accountant_supports()
        self.sum_mechanism = self._adaptive_clipping() if self.config.adaptive_clipping else self.mechanism

    def _adaptive_clipping(self) -> NoiseMechanism:
        """Set up :attr:`adaptive` (its bound restored from a checkpoint if one was loaded) and return the mechanism
        of the clipped sum, ``GaussianMechanism(sigma_sum, C_t)`` (:mod:`lightning_dp.optim.adaptive_clipping`): one
        object for the engine's life, which every optimizer it wrapped holds and :meth:`_set_clip_bound` updates.

        Raises:
            ValueError: ``unclipped_num_std <= noise_multiplier / 2``.
        """
        assert self.mechanism is not None and self.sample_rate is not None and self.num_samples is not None
        config = self.config
        expected_batch_size = self.sample_rate * self.num_samples
        count_std = config.unclipped_num_std
        if count_std is None:
            count_std = expected_batch_size * DEFAULT_COUNT_NOISE_FRACTION
            default = f"unclipped_num_std = q N / 20 = {count_std:.4g} (adaptive clipping's count noise, Andrew et al.)"
            if default not in self.defaults_applied:
                self.defaults_applied.append(default)
        sum_sigma = sum_noise_multiplier(self.mechanism.noise_multiplier, count_std)
        self.adaptive = AdaptiveClipping(
            initial_bound=self._restored_clip_bound or self.current_max_grad_norm,
            target_unclipped_quantile=config.target_unclipped_quantile,
            clipbound_learning_rate=config.clipbound_learning_rate,
            unclipped_num_std=count_std,
            expected_batch_size=expected_batch_size,
            min_clipbound=config.min_clipbound,
            max_clipbound=config.max_clipbound,
        )
        self._restored_clip_bound = None
        if isinstance(self.sum_mechanism, GaussianMechanism) and self.sum_mechanism is not self.mechanism:
            # prepared again (another fit): the optimizer wrapped before holds this object, so it is updated in place
            self.sum_mechanism.noise_multiplier = sum_sigma
        else:
            self.sum_mechanism = GaussianMechanism(sum_sigma, self.adaptive.bound)
        self._set_clip_bound(self.adaptive.bound)
        return self.sum_mechanism

    def _set_clip_bound(self, bound: float) -> None:
        """Clip at ``bound`` from the next micro-batch on, and noise the next sum for it."""
        self.current_max_grad_norm = bound
        if self.clipper is not None:
            self.clipper.max_grad_norm = bound
        if self.sum_mechanism is not None and self.sum_mechanism is not self.mechanism:
            self.sum_mechanism.max_grad_norm = bound

    def move_clip_bound(self) -> None:
        """Adaptive clipping, after a step: release the step's centred count of unclipped examples (summed over
        the ranks, noised once from the shared noise stream) and move the bound for the next step."""
        assert self.adaptive is not None and self.clipper is not None
        params = self.clipper.trainable_parameters
        count = self.adaptive.count_tensor(params[0].device if params else torch.device("cpu"))
        if self.distributed is not None:
            self.distributed.reduce_clipped_sum([count])
        count_noise = GaussianMechanism(self.adaptive.unclipped_num_std, 1.0)
        generator = self.randomness.noise_generator(count.device)
        noise = (
            secure_sample(count_noise, count, generator) if self.secure_mode else count_noise.sample(count, generator)
        )
        self._set_clip_bound(self.adaptive.update(noise))

    def _default_accountant(self) -> str:
        """``"rc"`` for randomized clipping, else the mechanism's sound default."""
        mechanism = self.mechanism or mechanism_class(self.noise_name)
        return "rc" if self.randomized_clipping else mechanism.default_accountant

    def _calibrate(self, total_steps: int | None) -> NoiseMechanism:
        """The mechanism calibrated for ``target_epsilon`` over ``total_steps`` steps."""
        from lightning_dp.mechanisms.calibration import calibrate

        if total_steps is None:
            raise ValueError(
                "target_epsilon needs a finite number of steps to calibrate the noise for: set max_epochs or "
                "max_steps, or give the noise (noise_multiplier / noise_params) and use PrivacyBudget to stop"
            )
        if self.randomized_clipping:
            assert self.clipper is not None and self.norm_dim is not None
            mechanism = calibrate_randomized_clipping(
                target_epsilon=self.target_epsilon,
                target_delta=self.target_delta,
                sample_rate=self.sample_rate,
                steps=total_steps,
                projection_dim=self.clipper.engine.projection_dim,
                norm_dim=self.norm_dim,
                estimator=self.clipper.engine.estimator,
                max_grad_norm=self.max_grad_norm,
            ).mechanism
        else:
            mechanism = calibrate(
                self.noise_name,
                target_epsilon=self.target_epsilon,
                target_delta=self.target_delta,
                sample_rate=self.sample_rate,
                steps=total_steps,
                max_grad_norm=self.max_grad_norm,
                num_params=self.num_params,
                accountant=self.accountant_name,
            )
        self.noise_origin = f"calibrated for epsilon={self.target_epsilon:.4g} over {total_steps} steps"
        return mechanism

    def _check_accountant_supports(self) -> None:
        assert self.accountant is not None and self.mechanism is not None
        event = self.step_event()
        if not self.accountant.supports(event):
            raise ValueError(
                f"Accountant {self.accountant.name!r} cannot account for {self.mechanism.name!r} noise; "
                f"use accountant={self._default_accountant()!r}"
            )

    def wrap_optimizer(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        reduce_clipped_sum: Callable[[Sequence[torch.Tensor]], None] | None = None,
        any_rank: Callable[[Sequence[bool]], list[bool]] | None = None,
    ) -> DPOptimizer:
        """Wrap the user's optimizer so each step is privatised and recorded.

        Args:
            optimizer: the user's optimizer.
            reduce_clipped_sum: on several processes, the SUM all-reduce of the clipped sums (e.g.
                ``distributed_context().reduce_clipped_sum``); ``None`` on one process. See
                :mod:`lightning_dp.runtime.distributed` for what else a multi-process run needs.
            any_rank: on several processes, the OR of flags over the ranks (``distributed_context().any_rank``),
                which the finite check of sharded (FSDP2) gradient sums needs; ``None`` on one process.
        """
        if self.sum_mechanism is None or self.sample_rate is None or self.num_samples is None:
            raise RuntimeError("prepare() must run before wrap_optimizer()")
        return DPOptimizer(
            optimizer,
            mechanism=self.sum_mechanism,
            expected_batch_size=self.sample_rate * self.num_samples,
            randomness=self.randomness,
            on_step=self.record_step,
            before_update=self.momentum.record,  # the iterate x_t, stored right before the update to x_{t+1}
            should_skip=self.budget_exhausted,
            reduce_clipped_sum=reduce_clipped_sum,
            any_rank=any_rank,
            secure_mode=self.secure_mode,
            postprocess=self.lowpass.apply_ if self.lowpass is not None else None,
        )


PrivacyEngine.__doc__ = PrivacyEngine.__doc__.replace(" " * 12 + "{options}", option_docs(indent=12))
