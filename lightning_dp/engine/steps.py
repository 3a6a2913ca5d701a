"""The run sequence of DP training, which every trainer adapter drives through its framework's hooks.

``PrivacyEngine.begin_fit`` (before a checkpoint is loaded with ``PrivacyEngine.load_state_dict``),
:meth:`RunSequence.start_run`, :meth:`~RunSequence.training_loader`, :meth:`~RunSequence.start_training`, then per
micro-batch :meth:`~RunSequence.per_sample_loss` and :meth:`~RunSequence.clip`, and :meth:`~RunSequence.finish_run`
(docs/design.md section 2.2; the stand-in batch of a sharded model: section 8.1).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_collate

from lightning_dp.checks.attach_probe import ForwardContext
from lightning_dp.checks.guard import TrainingGuard
from lightning_dp.clipping import PerSampleClipper
from lightning_dp.data import EmptyBatchCollate, PoissonBatchSampler, expected_batch_sample_rate, poisson_dataloader
from lightning_dp.data.cyclic_poisson import CyclicPoissonBatchSampler, blt_num_groups
from lightning_dp.data.example_lists import example_copy
from lightning_dp.data.users import UserCollate, UserDataset, UserDraws, flatten_users, read_user_ids, user_losses
from lightning_dp.engine.attachment import ClippingAttachment
from lightning_dp.engine.end_of_run import log_end_of_run
from lightning_dp.engine.noise_setup import NoiseSetup
from lightning_dp.engine.run_state import RunState
from lightning_dp.engine.startup import StartupBlock
from lightning_dp.engine.workload import training_workload
from lightning_dp.optim import DPOptimizer
from lightning_dp.runtime.distributed import DistributedContext

log = logging.getLogger("lightning_dp")

LossFunction = Callable[[Any], torch.Tensor | None]


class RunSequence:
    """The run sequence over the run's :class:`~lightning_dp.engine.run_state.RunState`: clipping hooks, noise set-up,
    start-up block and the engine's ``wrap_optimizer``.
    """

    def __init__(
        self,
        state: RunState,
        attachment: ClippingAttachment,
        noise_setup: NoiseSetup,
        startup: StartupBlock,
        wrap_optimizer: Callable[..., DPOptimizer],
    ) -> None:
        self.state = state
        self.attachment = attachment
        self.noise_setup = noise_setup
        self.startup = startup
        self.wrap_optimizer = wrap_optimizer

    @property
    def _clipper(self) -> PerSampleClipper:
        if self.state.clipper is None:
            raise RuntimeError("start_run(module, ...) must run first: no clipping hooks are attached")
        return self.state.clipper

    @property
    def _guard(self) -> TrainingGuard:
        if self.state.guard is None:
            raise RuntimeError("start_run(module, ...) must run first: no training checks are attached")
        return self.state.guard

    # -------------------------------------------------------------------------------------------- per run
    def start_run(
        self,
        module: nn.Module,
        distributed: DistributedContext | None,
        forward_context: ForwardContext = nullcontext,
    ) -> None:
        """Attach the clipping hooks to ``module`` (its probe under ``forward_context()``, the training's autocast);
        on several processes, adopt rank 0's base seed.

        Raises:
            UnsupportedModuleError: unsupported layers (see
                :meth:`~lightning_dp.engine.attachment.ClippingAttachment.attach`).
        """
        state = self.state
        self.attachment.attach(module, forward_context)
        state.distributed = distributed
        state.micro_batches = 0
        if state.adaptive is not None:  # a step cut off before its update must not add its count to the next one's
            state.adaptive.discard_count()
        state.dropped_nonfinite = False  # reported per run (finish_run)
        if distributed is not None:
            distributed.synchronize_randomness(state.randomness)
            if self._clipper.sharded:  # the checks' extra passes are collectives there: all ranks run them together
                self._guard.lockstep = distributed.max_over_ranks

    def training_loader(
        self,
        loader: DataLoader,
        *,
        batch_size: int | None,
        micro_batches: int,
        lengths: Sequence[int] | torch.Tensor | None = None,
        user_ids: Sequence[Hashable] | None = None,
    ) -> DataLoader:
        """The training loader the run uses: Poisson batches of this rank's shard at the global rate q (default
        ``batch_size * micro_batches * W / N``), or ``loader`` itself with ``poisson_sampling=False`` (one process,
        warned).

        Args:
            loader: the trainer's training loader (a map-style dataset).
            batch_size: its per-process batch size (``None``: ``sample_rate`` must be given).
            micro_batches: micro-batches per optimizer step (gradient accumulation).
            lengths: ``[N]`` example lengths, to form micro-batches of similar lengths; ``None`` keeps the data order.
            user_ids: with ``privacy_unit="user"``, ``[N]`` each example's user; ``None``: read from the dataset.

        With ``privacy_unit="user"`` the dataset is regrouped by user (N users, q per user;
        :mod:`lightning_dp.data.users`) and batches are :class:`~lightning_dp.data.users.UserBatch`.

        Raises:
            TypeError: not a torch ``DataLoader`` over a map-style dataset.
            ValueError: unknown batch size and no ``sample_rate``; the data changed size; ``poisson_sampling=False`` on
                several processes or with an epoch that is not a whole number of optimizer steps.
        """
        state = self.state
        if not isinstance(loader, DataLoader) or not hasattr(loader.dataset, "__len__"):
            raise TypeError("DP training needs a torch DataLoader over a map-style dataset (with __len__)")
        dataset, collate_fn = loader.dataset, loader.collate_fn
        if state.config.privacy_unit == "user":
            dataset = self._users(dataset, user_ids)
            collate_fn = UserCollate(loader.collate_fn or default_collate, dataset)
            if lengths is not None:
                log.warning("privacy_unit='user': the Poisson batches of users are not grouped by length")
                lengths = None
        num_samples = len(dataset)
        rank, world_size = (state.distributed.rank, state.distributed.world_size) if state.distributed else (0, 1)
        sample_rate = state.config.sample_rate
        if sample_rate is None:
            if not batch_size:
                raise ValueError("Cannot infer the expected batch size: pass the privacy option sample_rate=...")
            sample_rate = expected_batch_sample_rate(
                num_samples=num_samples, batch_size=batch_size, micro_batches=micro_batches, world_size=world_size
            )
            if state.loader_rate is None:  # the first training loader of the run
                state.defaults_applied.append(
                    f"sample_rate = batch_size {batch_size} x accumulation {micro_batches} x {world_size} "
                    f"process(es) / N {num_samples} = {sample_rate:.4g} (Poisson sampling)"
                )
        if state.loader_rate is not None and (num_samples, sample_rate) != (state.num_samples, state.loader_rate):
            raise ValueError(
                f"The training data changed during the run (N {state.num_samples} -> {num_samples}, q "
                f"{state.loader_rate} -> {sample_rate}): reloading data of another size is not supported under DP, "
                "the accountant and the noise scale assume one dataset"
            )
        if state.config.noise_correlation is not None:  # groups are keyed by index: the index -> example map stays
            if state.partitioned_dataset is not None and loader.dataset is not state.partitioned_dataset:
                raise ValueError(
                    f"noise_correlation={state.config.noise_correlation!r} partitions the training set by index, so "
                    "the training DataLoader must keep the same dataset object for the whole run: do not rebuild or "
                    "reorder it (reload_dataloaders_every_n_epochs, a new Subset each epoch)"
                )
            state.partitioned_dataset = loader.dataset
        state.num_samples, state.loader_rate = num_samples, sample_rate
        state.loader_batches = (batch_size, micro_batches)
        state.length_grouped = lengths is not None and state.config.poisson_sampling
        state.stand_in_source = (collate_fn, dataset, rank)
        if state.config.poisson_sampling:
            collate_fn = EmptyBatchCollate(collate_fn, dataset)  # a stand-in batch is marked as the drawn ones are
            state.stand_in_source = (collate_fn, dataset, rank)
            return poisson_dataloader(
                loader,
                dataset=dataset,
                collate_fn=collate_fn,
                wrap_sampler=UserDraws if state.config.privacy_unit == "user" else None,
                sampler_class=self._sampler_class(sample_rate),
                sample_rate=sample_rate,
                micro_batches=micro_batches,
                generator=state.randomness.sampling,
                rank=rank,
                world_size=world_size,
                lengths=lengths,
            )
        if world_size > 1:
            raise ValueError(
                "poisson_sampling=False is not supported on several processes: keep poisson_sampling=True (each "
                "rank then Poisson-samples its shard of the whole dataset)"
            )
        log.warning(
            "poisson_sampling=False: batches come from your sampler, but the reported epsilon assumes Poisson "
            "sampling with q=%.4g; it is not a guarantee for shuffled fixed-size batches",
            sample_rate,
        )
        if len(loader) % micro_batches:
            raise ValueError(
                f"{len(loader)} batches per epoch is not a multiple of {micro_batches} micro-batches per optimizer "
                "step: the last step would use fewer examples than the others; choose sizes that divide evenly, or "
                "keep poisson_sampling=True"
            )
        return loader

    def _sampler_class(self, sample_rate: float) -> Callable[..., PoissonBatchSampler]:
        """The training loader's batch sampler: Poisson, or with ``noise_correlation`` cyclic Poisson over ``b`` groups
        (:mod:`lightning_dp.data.cyclic_poisson`), passes starting at the run's step count (each step's draws keyed by
        the step with ``exact_resume``)."""
        config, randomness = self.state.config, self.state.randomness
        step_seed = randomness.step_sampling_seed if config.exact_resume else None
        steps: dict[str, Any] = {"next_step": lambda: self.state.steps, "step_seed": step_seed}
        if config.noise_correlation is None:
            return functools.partial(PoissonBatchSampler, **steps)
        groups = config.correlation_band if config.noise_correlation == "banded" else blt_num_groups(sample_rate)
        assert groups is not None  # PrivacyConfig requires the band of noise_correlation='banded'
        key = functools.partial(randomness.stream_seed, "cyclic groups")  # read as each pass starts
        return functools.partial(CyclicPoissonBatchSampler, num_groups=groups, key=key, **steps)

    def _users(self, dataset: Any, user_ids: Sequence[Hashable] | None) -> UserDataset:
        """The training set regrouped by user (:mod:`lightning_dp.data.users`), built once per dataset.

        Raises:
            ValueError: an example without the ``user_key`` column; ``user_ids`` of another length than the data.
        """
        state = self.state
        if state.user_data is not None and state.user_data.dataset is dataset:
            return state.user_data
        key = state.config.user_key
        assert key is not None  # privacy_unit="user" requires it (PrivacyConfig)
        ids = list(user_ids) if user_ids is not None else read_user_ids(dataset, key)
        users = UserDataset(
            dataset,
            ids,
            state.config.examples_per_user,
            seed=state.randomness.stream_seed("user subsets"),
            drop_key=key if isinstance(key, str) else None,
        )
        used = users.counts.clamp(max=users.examples_per_user)
        padding = 1 - float(used.sum()) / (len(users) * users.examples_per_user)
        if padding > 0.5:  # local advice only: no count of the data in the message
            log.warning(
                "privacy_unit='user': most of the rows a step computes are padding (each sampled user brings "
                "examples_per_user rows, most users have fewer examples); a smaller examples_per_user costs less (it "
                "caps the examples a user contributes per step, not the guarantee)"
            )
        state.user_data = users
        self.attachment.set_rows_per_unit(state.config.augmentation_multiplicity * users.examples_per_user)
        return users

    def start_training(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        total_steps: int | None,
        learning_rates: Sequence[float] | None = None,
    ) -> list[DPOptimizer]:
        """Fix delta, the noise (calibrated for ``total_steps`` if needed) and the accountant, check the ranks agree,
        log the start-up block, and return the optimizers wrapped to privatise and record each step (correlated
        noise: for :func:`~lightning_dp.engine.workload.training_workload` of ``optimizers`` and ``learning_rates``).

        Raises:
            RuntimeError: no training loader yet; ranks that disagree.
            ValueError: as :meth:`~lightning_dp.engine.noise_setup.NoiseSetup.prepare`.
        """
        state = self.state
        if state.num_samples is None or state.loader_rate is None:
            raise RuntimeError("the training loader must be built (training_loader) before training starts")
        state.planned_steps = total_steps
        workload = training_workload(optimizers, learning_rates, total_steps)  # used by correlated noise only
        self.noise_setup.prepare(
            num_samples=state.num_samples, sample_rate=state.loader_rate, total_steps=total_steps, workload=workload
        )
        mechanism = state.mechanism
        assert mechanism is not None  # fixed by prepare
        collectives: dict[str, Any] = {}
        if state.distributed is not None:
            correlation = state.correlation
            state.distributed.check_identical(
                "dataset size, sample rate, noise, adaptive clipping, noise correlation and max_physical_batch_size",
                (
                    state.num_samples,
                    state.sample_rate,
                    mechanism.name,
                    mechanism.describe(),
                    state.adaptive.describe() if state.adaptive is not None else None,
                    None if correlation is None else (correlation.checkpoint_entry(), correlation.segment),
                    state.config.max_physical_batch_size,  # a capped sharded model's ranks MAX their pass counts
                ),
            )
            collectives = {
                "reduce_clipped_sum": state.distributed.reduce_clipped_sum,
                "any_rank": state.distributed.any_rank,
            }
        self.startup.log_startup()
        return [opt if isinstance(opt, DPOptimizer) else self.wrap_optimizer(opt, **collectives) for opt in optimizers]

    # ------------------------------------------------------------------------------------------- per step
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
        """The per-sample losses ``[B]`` of one micro-batch, with the run's checks around the user's forward
        (docs/design.md section 2.2, steps 2-5).

        Args:
            batch: the micro-batch (a :class:`~lightning_dp.data.users.UserBatch` with ``privacy_unit="user"``: the loss
                functions run on its rows ``[U K, ...]`` and each user's loss is the weighted mean of their rows').
            batch_size: its number of examples (users); ``None`` when unreadable.
            compute_loss: ``batch -> [B]`` per-sample loss (``None``: the step skips the batch).
            replay: the same for the extra forwards (stored iterates, leave-half-out); default ``compute_loss``.
            module: the model.
            stand_in: ``batch`` is :meth:`stand_in_batch`: the forwards at stored iterates run with weight 0.

        Returns:
            The per-sample losses, or ``None`` when the user's step skipped the batch.

        Raises:
            UnsupportedModuleError, BatchMixingError: a check failed (:mod:`lightning_dp.checks`).
            ValueError: on an FSDP2-sharded model, an unreadable batch size or a step returning ``None``.
        """
        state = self.state
        replay = replay or compute_loss
        if state.config.privacy_unit == "user":
            compute_loss, replay = _per_user(compute_loss), _per_user(replay)
        if batch_size is None and self.every_rank_runs_every_step:
            raise ValueError(
                "the batch size cannot be read from the training batch, which an FSDP2-sharded model needs (a rank "
                "with an empty batch must run the step on a stand-in batch, or the other ranks would wait for it): "
                "return tensors with the examples along their first dimension from the training loader"
            )
        guard = self._guard
        guarded = guard.before_forward(batch, batch_size)
        if state.momentum.enabled:
            self.attachment.add_past_iterates(lambda: guard.forward(replay, guarded), stand_in=stand_in)
        loss = guard.forward(compute_loss, guarded)
        if loss is None:
            if self.every_rank_runs_every_step:
                raise ValueError(
                    "training_step returned None on an FSDP2-sharded model: every rank must run every step's "
                    "backward (the others would wait for this rank in the collectives); return the per-sample loss"
                )
            self._clipper.discard_past_iterates()
            return None
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"the per-sample loss must be a tensor of shape [B], got {type(loss).__name__}")
        self._guard.after_forward(loss)
        self._guard.leave_half_out(replay, batch, len(loss), module)
        return loss

    @property
    def every_rank_runs_every_step(self) -> bool:
        """Whether a rank must run forward and backward even on an empty micro-batch (FSDP2-sharded model); it then runs
        :meth:`stand_in_batch`.
        """
        state = self.state
        return state.clipper is not None and state.clipper.sharded

    def stand_in_batch(self) -> Any:
        """A one-example batch (this rank's first example, collated, on the CPU) for a rank whose micro-batch is empty
        when :attr:`every_rank_runs_every_step`; run with ``stand_in=True`` it adds exactly zero (docs/design.md section
        8.1).

        Raises:
            RuntimeError: before :meth:`training_loader`.
        """
        state = self.state
        if state.stand_in_source is None:
            raise RuntimeError("the training loader must be built (training_loader) before a stand-in batch")
        collate, dataset, rank = state.stand_in_source
        return collate([example_copy(dataset[rank % len(dataset)])])  # a collate must not change the stored example

    def clip(self, per_sample_loss: torch.Tensor, *, stand_in: bool = False) -> torch.Tensor:
        """Add this micro-batch's clipped sum into ``p.grad``; returns the norms ``[B]``
        (:meth:`~lightning_dp.clipping.PerSampleClipper.backward`). With ``stand_in``, weight 0 and norms ``[0]``.
        """
        state = self.state
        if stand_in:
            self._clipper.backward(per_sample_loss, weight=0.0)
            return per_sample_loss.new_zeros(0).detach()
        norms = self._clipper.backward(per_sample_loss, weight=state.momentum.current_weight)
        if state.adaptive is not None:
            state.adaptive.count(norms)
        if norms.numel():  # read when asked for (PrivacyEngine.last_clip_fraction), never per step
            state.last_clip_fraction = self._clipper.clip_fraction(norms)
        return norms

    def finish_run(self) -> None:
        """At the normal end of training (a collective on several processes; never on an error path): rank 0 warns once
        each for dropped non-finite examples, a postponed sum check that never ran, and an inconclusive independence
        check (docs/privacy.md, "Non-finite losses and gradients", "Run-time checks"). Flags are OR-ed over ranks; no
        count is released.
        """
        state = self.state
        clipper = state.clipper
        flags = [
            state.dropped_nonfinite or (clipper is not None and clipper.dropped_nonfinite),
            clipper is not None and clipper.sum_check_postponed,
            state.guard is not None and state.guard.unresolved,
        ]
        if state.distributed is not None:
            flags = state.distributed.any_rank(flags)
        log_end_of_run(*flags)

    def start_batch(self) -> None:
        """Begin a micro-batch (before its passes): they share one slot of the sum check's schedule
        (:meth:`~lightning_dp.clipping.sample_norms.SampleNormsMixin.start_batch`)."""
        self._clipper.start_batch()

    def count_micro_batch(self) -> None:
        """Count one micro-batch of the current logical step."""
        self.state.micro_batches += 1

    def end_logical_step(self, micro_batches: int) -> None:
        """Check, at an optimizer step, that exactly ``micro_batches`` micro-batches were counted since the last one.

        Raises:
            RuntimeError: another count: the optimizer step would not use exactly one Poisson sample.
        """
        state = self.state
        counted, state.micro_batches = state.micro_batches, 0
        if counted != micro_batches:
            raise RuntimeError(
                f"An optimizer step after {counted} micro-batches, expected {micro_batches}: a logical step must be "
                "exactly one Poisson sample"
            )


def _per_user(compute_loss: LossFunction) -> LossFunction:
    """``compute_loss`` on a user batch: per-row losses reduced per user (:func:`~lightning_dp.data.users.user_losses`),
    ``[U]``."""

    def users_loss(batch: Any) -> torch.Tensor | None:
        rows, weights = flatten_users(batch)
        loss = compute_loss(rows)
        return None if loss is None else user_losses(loss, weights)

    return users_loss
