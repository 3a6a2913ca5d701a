"""PrivacyEngine: the framework-agnostic DP state of one training run.

It owns the :class:`~lightning_dp.engine.run_state.RunState` and the parts acting on it (``attachment``,
``noise_setup``, ``ledger``, ``clip_bound``, ``checkpoint``, ``startup``, ``run``); the adapters call only the engine
(docs/design.md section 2.1).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_dp.accounting import Accountant
from lightning_dp.checks.attach_probe import ForwardContext
from lightning_dp.checks.guard import TrainingGuard
from lightning_dp.clipping import PerSampleClipper
from lightning_dp.clipping.groups import ClippingGroups
from lightning_dp.config import PrivacyConfig, option_docs
from lightning_dp.data import EmptyBatchCollate
from lightning_dp.engine.accounting import PrivacyLedger
from lightning_dp.engine.attachment import ClippingAttachment
from lightning_dp.engine.checkpoint import CheckpointState
from lightning_dp.engine.clip_bound import ClipBound
from lightning_dp.engine.exact_resume import abandon_load, check_draw_schedule, continued_stream, finish_restore
from lightning_dp.engine.noise_setup import NoiseSetup, default_delta
from lightning_dp.engine.optimizer_checks import check_optimizers
from lightning_dp.engine.run_state import RunState, RunStateField
from lightning_dp.engine.startup import StartupBlock, describe_users
from lightning_dp.engine.steps import LossFunction, RunSequence
from lightning_dp.mechanisms import NoiseMechanism, make_mechanism
from lightning_dp.optim import DPOptimizer, DPRandomness, make_lowpass
from lightning_dp.optim.adaptive_clipping import AdaptiveClipping
from lightning_dp.optim.lowpass import LowPassFilter
from lightning_dp.optim.momentum import PerSampleMomentum
from lightning_dp.runtime.distributed import DistributedContext

__all__ = ["PrivacyEngine", "default_delta"]

log = logging.getLogger("lightning_dp")


class PrivacyEngine:
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

    # The run's state, read (and set) as attributes of the engine; see RunState for each.
    config = RunStateField[PrivacyConfig]()
    momentum = RunStateField[PerSampleMomentum]()
    randomness = RunStateField[DPRandomness]()
    max_grad_norm = RunStateField[float]()
    current_max_grad_norm = RunStateField[float]()
    clipping = RunStateField[str]()
    lowpass = RunStateField[LowPassFilter | None]()
    mechanism = RunStateField[NoiseMechanism | None]()
    sum_mechanism = RunStateField[NoiseMechanism | None]()
    noise_origin = RunStateField[str | None]()
    target_delta = RunStateField[float | None]()
    defaults_applied = RunStateField[list[str]]()
    accountant = RunStateField[Accountant | None]()
    clipper = RunStateField[PerSampleClipper | None]()
    guard = RunStateField[TrainingGuard | None]()
    clipping_groups = RunStateField[ClippingGroups | None]()
    dropped_nonfinite = RunStateField[bool]()
    broken_for_testing = RunStateField[str | None]()
    norm_dim = RunStateField[int | None]()
    sample_rate = RunStateField[float | None]()
    num_samples = RunStateField[int | None]()
    num_params = RunStateField[int | None]()
    epsilon_budget = RunStateField[float | None]()
    adaptive = RunStateField[AdaptiveClipping | None]()
    distributed = RunStateField[DistributedContext | None]()
    loader_batches = RunStateField[tuple[int | None, int] | None]()
    length_grouped = RunStateField[bool]()
    planned_steps = RunStateField[int | None]()

    def __init__(self, config: PrivacyConfig | None = None, **options: Any) -> None:
        if config is None:
            config = PrivacyConfig(**options)
        elif options:
            raise ValueError(f"give either a PrivacyConfig or its options as keywords, not both ({sorted(options)})")
        clipping, reason = config.resolved_clipping()
        self.state = state = RunState(
            config=config,
            momentum=PerSampleMomentum(config.momentum_length, config.momentum_beta),
            randomness=DPRandomness(config.seed, secure=bool(config.secure_mode)),
            max_grad_norm=config.sensitivity,
            current_max_grad_norm=config.sensitivity,
            clipping=clipping,
            randomized_clipping=config.randomized_clipping,
            auto_clipping=None if reason is None else f"clipping = {clipping!r} with book-keeping (auto: {reason})",
            lowpass=make_lowpass(config.lowpass),
            target_delta=config.target_delta,
        )
        # fixed noise is built (and validated) here; with target_epsilon it is calibrated by prepare
        if isinstance(config.noise, NoiseMechanism):
            state.mechanism = config.noise
        elif config.target_epsilon is None:
            params = dict(config.noise_params or {})
            if config.noise_multiplier is not None:
                params["noise_multiplier"] = config.noise_multiplier
            state.mechanism = make_mechanism(config.noise, max_grad_norm=state.max_grad_norm, **params)
        state.noise_origin = "given" if state.mechanism is not None else None
        if state.mechanism is not None and state.mechanism.is_noiseless:
            log.warning(
                "%s adds no noise (%s): no finite epsilon holds, the run is NOT differentially private and reports "
                "epsilon = inf",
                state.mechanism.name,
                state.mechanism.describe(),
            )
        self.ledger = PrivacyLedger(state)
        self.clip_bound = ClipBound(state)
        self.attachment = ClippingAttachment(state)
        self.noise_setup = NoiseSetup(state, self.ledger, self.clip_bound)
        self.checkpoint = CheckpointState(state, self.clip_bound, self.ledger)
        self.startup = StartupBlock(state)
        self.run = RunSequence(state, self.attachment, self.noise_setup, self.startup, self.wrap_optimizer)
        #: the optimizers :meth:`wrap_optimizer` returned in this run (their deferred finite checks: check_finite)
        self._optimizers: list[DPOptimizer] = []

    # ----------------------------------------------------------------------------------------------- options
    @property
    def noise_name(self) -> str:
        """The mechanism's registry name."""
        return self.config.noise_name

    @property
    def noise(self) -> str | NoiseMechanism:
        """The ``noise`` option: a registry name or a ready mechanism."""
        return self.config.noise

    @property
    def target_epsilon(self) -> float | None:
        """The ``target_epsilon`` option."""
        return self.config.target_epsilon

    @property
    def accountant_name(self) -> str | None:
        """The ``accountant`` option (``None``: the mechanism's sound default)."""
        return self.config.accountant

    @property
    def randomized_clipping(self) -> bool:
        """Whether the clipping engine clips by a random norm estimate (hutch, hutchpp)."""
        return self.state.randomized_clipping

    @property
    def secure_mode(self) -> bool:
        """The ``secure_mode`` option."""
        return bool(self.config.secure_mode)

    @property
    def sum_check_every(self) -> int | None:
        """The ``sum_check_every`` option."""
        return self.config.sum_check_every

    @property
    def projection_dim(self) -> int | None:
        """The ``projection_dim`` option."""
        return self.config.projection_dim

    @property
    def check_batch_independence(self) -> bool:
        """The ``check_batch_independence`` option."""
        return bool(self.config.check_batch_independence)

    @property
    def check_batch_independence_every(self) -> int | None:
        """The ``check_batch_independence_every`` option."""
        return self.config.check_batch_independence_every

    # ------------------------------------------------------------------------------------ set-up and noise
    def attach(self, module: nn.Module, forward_context: ForwardContext = nullcontext) -> PerSampleClipper:
        """See :meth:`~lightning_dp.engine.attachment.ClippingAttachment.attach`."""
        return self.attachment.attach(module, forward_context)

    @property
    def rows_per_unit(self) -> int:
        """See :attr:`~lightning_dp.engine.run_state.RunState.rows_per_unit`."""
        return self.state.rows_per_unit

    def set_rows_per_unit(self, rows: int) -> None:
        """See :meth:`~lightning_dp.engine.attachment.ClippingAttachment.set_rows_per_unit`."""
        self.attachment.set_rows_per_unit(rows)

    def detach(self) -> None:
        """See :meth:`~lightning_dp.engine.attachment.ClippingAttachment.detach`."""
        self.attachment.detach()

    def add_past_iterates(self, compute_loss: Callable[[], torch.Tensor | None], *, stand_in: bool = False) -> None:
        """See :meth:`~lightning_dp.engine.attachment.ClippingAttachment.add_past_iterates`."""
        self.attachment.add_past_iterates(compute_loss, stand_in=stand_in)

    def prepare(self, *, num_samples: int, sample_rate: float, total_steps: int | None) -> None:
        """See :meth:`~lightning_dp.engine.noise_setup.NoiseSetup.prepare`."""
        self.noise_setup.prepare(num_samples=num_samples, sample_rate=sample_rate, total_steps=total_steps)

    def move_clip_bound(self) -> None:
        """See :meth:`~lightning_dp.engine.clip_bound.ClipBound.move`."""
        self.clip_bound.move()

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
            reduce_clipped_sum: on several processes, the SUM all-reduce of the clipped sums
                (``distributed_context().reduce_clipped_sum``); ``None`` on one process.
            any_rank: on several processes, the OR of flags over ranks (``distributed_context().any_rank``); ``None`` on
                one process.

        Raises:
            RuntimeError: before :meth:`prepare`.
        """
        state = self.state
        if state.sum_mechanism is None or state.sample_rate is None or state.num_samples is None:
            raise RuntimeError("prepare() must run before wrap_optimizer()")
        wrapped = DPOptimizer(
            optimizer,
            mechanism=state.sum_mechanism,
            expected_batch_size=state.sample_rate * state.num_samples,
            randomness=state.randomness,
            on_step=self.record_step,
            before_update=state.momentum.record,  # the iterate x_t, stored right before the update to x_{t+1}
            should_skip=self.budget_exhausted,
            reduce_clipped_sum=reduce_clipped_sum,
            any_rank=any_rank,
            secure_mode=self.secure_mode,
            postprocess=state.lowpass.apply_ if state.lowpass is not None else None,
        )
        wrapped.correlation = continued_stream(state, wrapped.params)
        self._optimizers.append(wrapped)
        return wrapped

    # ---------------------------------------------------------------------------------------- run sequence
    def begin_fit(self, distributed: DistributedContext | None) -> None:
        """A fit begins, before it loads a checkpoint or builds anything of the run (a training loader built while the
        trainer sets up): the process group the loader samples this rank's shard of, rank 0's base seed
        (:meth:`start_run` does it again, a no-op), and ``exact_resume.abandon_load``."""
        abandon_load(self.state)
        self.state.distributed = distributed
        if distributed is not None:
            distributed.synchronize_randomness(self.state.randomness)

    def start_run(
        self, module: nn.Module, distributed: DistributedContext | None, forward_context: ForwardContext = nullcontext
    ) -> None:
        """See :meth:`~lightning_dp.engine.steps.RunSequence.start_run`."""
        self._optimizers, self.state.noise_streams = [], []
        self.run.start_run(module, distributed, forward_context)

    def training_loader(
        self,
        loader: DataLoader,
        *,
        batch_size: int | None,
        micro_batches: int,
        lengths: Sequence[int] | torch.Tensor | None = None,
        user_ids: Sequence[Hashable] | None = None,
    ) -> DataLoader:
        """See :meth:`~lightning_dp.engine.steps.RunSequence.training_loader`."""
        return self.run.training_loader(
            loader, batch_size=batch_size, micro_batches=micro_batches, lengths=lengths, user_ids=user_ids
        )

    @property
    def loader_sample_rate(self) -> float | None:
        """The sample rate fixed by :meth:`training_loader` (``None`` before it ran)."""
        return self.state.loader_rate

    def describe_users(self) -> str:
        """See :func:`~lightning_dp.engine.startup.describe_users`."""
        return describe_users(self.config)

    def start_training(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        total_steps: int | None,
        learning_rates: Sequence[float] | None = None,
    ) -> list[DPOptimizer]:
        """See :meth:`~lightning_dp.engine.steps.RunSequence.start_training`, after ``check_draw_schedule`` and, within
        it, ``check_optimizers``; then the restored noise streams must all have been taken (``finish_restore``)."""
        check_draw_schedule(self.state, optimizers, checks=lambda: check_optimizers(self.state, optimizers))
        wrapped = self.run.start_training(optimizers, total_steps=total_steps, learning_rates=learning_rates)
        finish_restore(self.state)
        return wrapped

    def per_sample_loss(
        self,
        batch: Any,
        batch_size: int | None,
        compute_loss: LossFunction,
        *,
        replay: LossFunction | None = None,
        module: nn.Module,
        stand_in: bool = False,
    ) -> torch.Tensor | None:
        """See :meth:`~lightning_dp.engine.steps.RunSequence.per_sample_loss`."""
        return self.run.per_sample_loss(
            batch, batch_size, compute_loss, replay=replay, module=module, stand_in=stand_in
        )

    @property
    def every_rank_runs_every_step(self) -> bool:
        """See :attr:`~lightning_dp.engine.steps.RunSequence.every_rank_runs_every_step`."""
        return self.run.every_rank_runs_every_step

    @property
    def example_paths(self) -> tuple[tuple[Any, ...], ...]:
        """Where the Poisson loader's batches hold one entry per example in a marked list or tuple
        (:attr:`~lightning_dp.data.EmptyBatchCollate.example_paths`); ``()`` without Poisson sampling."""
        collate = self.state.stand_in_source[0] if self.state.stand_in_source is not None else None
        return collate.example_paths if isinstance(collate, EmptyBatchCollate) else ()

    def stand_in_batch(self) -> Any:
        """See :meth:`~lightning_dp.engine.steps.RunSequence.stand_in_batch`."""
        return self.run.stand_in_batch()

    def clip(self, per_sample_loss: torch.Tensor, *, stand_in: bool = False) -> torch.Tensor:
        """See :meth:`~lightning_dp.engine.steps.RunSequence.clip`."""
        return self.run.clip(per_sample_loss, stand_in=stand_in)

    def start_batch(self) -> None:
        """See :meth:`~lightning_dp.engine.steps.RunSequence.start_batch`."""
        self.run.start_batch()

    def count_micro_batch(self) -> None:
        """See :meth:`~lightning_dp.engine.steps.RunSequence.count_micro_batch`."""
        self.run.count_micro_batch()

    def end_logical_step(self, micro_batches: int) -> None:
        """See :meth:`~lightning_dp.engine.steps.RunSequence.end_logical_step`."""
        self.run.end_logical_step(micro_batches)

    def finish_run(self) -> None:
        """:meth:`check_finite`, then :meth:`~lightning_dp.engine.steps.RunSequence.finish_run`."""
        self.check_finite()
        self.run.finish_run()

    # ------------------------------------------------------------------------------------------ accounting
    def step_event(self) -> Any:
        """See :meth:`~lightning_dp.engine.accounting.PrivacyLedger.step_event`."""
        return self.ledger.step_event()

    def record_step(self) -> None:
        """Record one completed logical step with the accountant; under adaptive clipping, then move the bound."""
        self.ledger.record_step()
        if self.state.adaptive is not None:
            self.clip_bound.move()

    @property
    def steps(self) -> int:
        """Logical steps taken (and accounted) so far."""
        return self.state.steps

    def epsilon(self, delta: float | None = None) -> float:
        """See :meth:`~lightning_dp.engine.accounting.PrivacyLedger.epsilon`."""
        return self.ledger.epsilon(delta)

    def max_steps_within(self, epsilon_budget: float) -> int:
        """See :meth:`~lightning_dp.engine.accounting.PrivacyLedger.max_steps_within`."""
        return self.ledger.max_steps_within(epsilon_budget)

    def budget_exhausted(self) -> bool:
        """See :meth:`~lightning_dp.engine.accounting.PrivacyLedger.budget_exhausted`."""
        return self.ledger.budget_exhausted()

    def set_epsilon_budget(self, target_epsilon: float | None, *, configured_in: str) -> None:
        """See :meth:`~lightning_dp.engine.accounting.PrivacyLedger.set_epsilon_budget`."""
        self.ledger.set_epsilon_budget(target_epsilon, configured_in=configured_in)

    def log_budget_stop(self) -> None:
        """See :meth:`~lightning_dp.engine.accounting.PrivacyLedger.log_budget_stop`."""
        self.ledger.log_budget_stop()

    def summary(self) -> dict[str, Any]:
        """See :meth:`~lightning_dp.engine.accounting.PrivacyLedger.summary`."""
        return self.ledger.summary()

    @property
    def last_clip_fraction(self) -> float | None:
        """Fraction of the last clipped pass's examples whose norm exceeded the bound (diagnostic only, never logged);
        computed when read (one host sync), so that no step syncs for it."""
        fraction = self.state.last_clip_fraction
        return None if fraction is None else fraction()

    def check_finite(self) -> None:
        """Read the deferred finite checks of the run's optimizers (:meth:`DPOptimizer.check_finite`; one host sync
        each): at checkpoints and at the end of a run, before anything of the model leaves the process.

        Raises:
            FloatingPointError: a clipped sum was not finite at a step since the last check.
        """
        for optimizer in list(self._optimizers):
            optimizer.check_finite()

    # ---------------------------------------------------------------------------- checkpoint and start-up
    def state_dict(self) -> dict[str, Any]:
        """See :meth:`~lightning_dp.engine.checkpoint.CheckpointState.state_dict`; first :meth:`check_finite` (a
        checkpoint is a release)."""
        self.check_finite()
        return self.checkpoint.state_dict()

    def load_state_dict(self, state: dict[str, Any], *, weights_follow: bool = False) -> None:
        """See :meth:`~lightning_dp.engine.checkpoint.CheckpointState.load_state_dict`."""
        self.checkpoint.load_state_dict(state, weights_follow=weights_follow)

    def startup_lines(self) -> list[str]:
        """See :meth:`~lightning_dp.engine.startup.StartupBlock.startup_lines`."""
        return self.startup.startup_lines()

    def log_startup(self) -> None:
        """See :meth:`~lightning_dp.engine.startup.StartupBlock.log_startup`."""
        self.startup.log_startup()


PrivacyEngine.__doc__ = (PrivacyEngine.__doc__ or "").replace(" " * 12 + "{options}", option_docs(indent=12))
