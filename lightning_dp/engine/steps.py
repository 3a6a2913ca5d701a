"""The run sequence of DP training, which every trainer adapter drives through its framework's hooks.

One run, whatever the trainer (docs/design.md section 2.2):

1. :meth:`RunSequence.start_run` (the trainer's set-up): attach the clipping hooks; on several processes, share the
   base seed of rank 0 (identical noise, distinct sampling shards).
2. :meth:`RunSequence.training_loader` (each training loader the trainer builds): the sample rate, the check that
   the data did not change, and the sampling policy (Poisson sampling of this rank's shard at the global rate, or
   the trainer's own batches with a warning on one process; an error on several).
3. :meth:`RunSequence.start_training` (once the planned steps are known): delta, noise (calibrated if needed),
   accountant, the ranks' agreement, the optimizers wrapped so that each step is privatised and recorded, and the
   start-up block on the ``lightning_dp`` logger (:mod:`lightning_dp.engine.startup`).
4. Per micro-batch, :meth:`RunSequence.per_sample_loss` (the guard around the user's forward, the forwards at the
   stored iterates of per-sample momentum, the batch-independence checks) and :meth:`RunSequence.clip` (the clipped
   sum into ``p.grad``); :meth:`RunSequence.count_micro_batch` / :meth:`RunSequence.end_logical_step` check that an
   optimizer step is exactly one Poisson sample. On an FSDP2-sharded model every rank must join every forward and
   backward (their collectives gather the weights), so a rank whose micro-batch is empty runs the step on
   :meth:`RunSequence.stand_in_batch` instead, with ``stand_in=True`` to both calls: it contributes exactly zero.

The adapters (:mod:`lightning_dp.lightning`, :mod:`lightning_dp.hf`) translate hooks into these calls and never
reach into the engine's parts (clipper, guard, momentum, randomness, mechanism).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data._utils.collate import default_collate

from lightning_dp.checks.guard import TrainingGuard
from lightning_dp.clipping import PerSampleClipper
from lightning_dp.data import expected_batch_sample_rate, poisson_dataloader
from lightning_dp.data.users import UserCollate, UserDataset, UserDraws, flatten_users, read_user_ids, user_losses
from lightning_dp.engine.attachment import ClippingAttachment
from lightning_dp.engine.end_of_run import log_end_of_run
from lightning_dp.engine.noise_setup import NoiseSetup
from lightning_dp.engine.run_state import RunState
from lightning_dp.engine.startup import StartupBlock
from lightning_dp.optim import DPOptimizer
from lightning_dp.runtime.distributed import DistributedContext

log = logging.getLogger("lightning_dp")

LossFunction = Callable[[Any], torch.Tensor | None]


class RunSequence:
    """The run sequence (see the module docstring) over the run's :class:`~lightning_dp.engine.run_state.RunState`,
    calling the parts it sequences: the clipping hooks, the noise set-up, the start-up block, and ``wrap_optimizer``
    (the engine's, which ties an optimizer to the ledger)."""

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
    def start_run(self, module: nn.Module, distributed: DistributedContext | None) -> None:
        """Attach the clipping hooks to ``module``; on several processes, adopt rank 0's base seed.

        Raises:
            UnsupportedModuleError: unsupported layers (see
                :meth:`~lightning_dp.engine.attachment.ClippingAttachment.attach`).
        """
        state = self.state
        self.attachment.attach(module)
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
        """The training loader the run uses: ``loader``'s dataset, collator and workers, drawing Poisson batches of
        this rank's shard at the global rate q (default ``batch_size * micro_batches * W / N``), or ``loader``
        itself with ``poisson_sampling=False`` (one process only, with a warning that epsilon assumes Poisson
        sampling).

        Args:
            loader: the trainer's training loader (a map-style dataset).
            batch_size: its per-process batch size (``None`` when unknown: then ``sample_rate`` must be given).
            micro_batches: micro-batches per optimizer step (gradient accumulation).
            lengths: ``[N]`` the examples' lengths, to split each Poisson batch into micro-batches of similar
                lengths (:class:`~lightning_dp.data.PoissonBatchSampler`); ``None`` (default) keeps the data order.
            user_ids: with ``privacy_unit="user"``, ``[N]`` the user of each example of ``loader``'s dataset (for a
                trainer whose loader has lost the ``user_key`` column); ``None`` (default): read from the dataset.

        With ``privacy_unit="user"`` the loader's dataset is regrouped by user (one item per user, N = the number of
        users, q per user; :mod:`lightning_dp.data.users`) and its batches are
        :class:`~lightning_dp.data.users.UserBatch` (the loader's collator applied to the sampled users' rows).

        Raises:
            TypeError: not a torch ``DataLoader`` over a map-style dataset.
            ValueError: the batch size unknown and no ``sample_rate``; the data changed size during the run;
                ``poisson_sampling=False`` on several processes, or with an epoch that is not a whole number of
                optimizer steps.
        """
        state = self.state
        if not isinstance(loader, DataLoader) or not hasattr(loader.dataset, "__len__"):
            raise TypeError("DP training needs a torch DataLoader over a map-style dataset (with __len__)")
        dataset, collate_fn = loader.dataset, loader.collate_fn
        if state.config.privacy_unit == "user":
            dataset, collate_fn = self._users(dataset, user_ids), UserCollate(loader.collate_fn or default_collate)
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
        state.num_samples, state.loader_rate = num_samples, sample_rate
        state.loader_batches = (batch_size, micro_batches)
        state.length_grouped = lengths is not None and state.config.poisson_sampling
        state.stand_in_source = (collate_fn, dataset, rank)
        if state.config.poisson_sampling:
            return poisson_dataloader(
                loader,
                dataset=dataset,
                collate_fn=collate_fn,
                wrap_sampler=UserDraws if state.config.privacy_unit == "user" else None,
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

    def _users(self, dataset: Any, user_ids: Sequence[Hashable] | None) -> UserDataset:
        """The training set regrouped by user (``privacy_unit="user"``; :mod:`lightning_dp.data.users`), built once
        per dataset; the clipper and the checks then treat each user's ``K`` rows as one unit.

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
        self, optimizers: Sequence[torch.optim.Optimizer], *, total_steps: int | None
    ) -> list[DPOptimizer]:
        """Fix delta, the noise (calibrated for ``total_steps`` if needed) and the accountant; on several
        processes check that every rank agrees on N, q and the noise; log the start-up block
        (:meth:`~lightning_dp.engine.startup.StartupBlock.log_startup`); return the optimizers wrapped so that each
        step adds the noise once to the (all-reduced) clipped sum and is recorded.

        Raises:
            RuntimeError: no training loader yet; ranks that disagree.
            ValueError: as :meth:`~lightning_dp.engine.noise_setup.NoiseSetup.prepare`; an optimizer updates tensors
                that are not parameters of the clipped model (their gradients would be noised but never clipped).
        """
        state = self.state
        if state.num_samples is None or state.loader_rate is None:
            raise RuntimeError("the training loader must be built (training_loader) before training starts")
        for optimizer in optimizers:
            if not isinstance(optimizer, DPOptimizer):
                self._check_optimizer_holds_model_parameters(optimizer)
        state.planned_steps = total_steps
        self.noise_setup.prepare(num_samples=state.num_samples, sample_rate=state.loader_rate, total_steps=total_steps)
        mechanism = state.mechanism
        assert mechanism is not None  # fixed by prepare
        collectives: dict[str, Any] = {}
        if state.distributed is not None:
            state.distributed.check_identical(
                "dataset size, sample rate, noise and adaptive clipping",
                (
                    state.num_samples,
                    state.sample_rate,
                    mechanism.name,
                    mechanism.describe(),
                    state.adaptive.describe() if state.adaptive is not None else None,
                ),
            )
            collectives = {
                "reduce_clipped_sum": state.distributed.reduce_clipped_sum,
                "any_rank": state.distributed.any_rank,
            }
        self.startup.log_startup()
        return [opt if isinstance(opt, DPOptimizer) else self.wrap_optimizer(opt, **collectives) for opt in optimizers]

    def _check_optimizer_holds_model_parameters(self, optimizer: torch.optim.Optimizer) -> None:
        """Raise unless every tensor ``optimizer`` updates is a parameter of the model the clipper is attached to."""
        state = self.state
        if state.clipper is None:
            return
        parameters = {id(p) for p in state.clipper.module.parameters()}
        foreign = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in parameters)
        if foreign:
            raise ValueError(
                f"the optimizer updates {foreign} tensor(s) that are not parameters of the model: their gradients "
                "would be noised but never clipped. Register them in the model, and build the optimizer from the "
                "model's parameters after any sharding (with accelerate's FSDP2 configuration DPTrainer shards the "
                "model itself, replacing its parameters: let the Trainer build the optimizer instead of passing "
                "optimizers=(optimizer, scheduler))"
            )

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
        """The per-sample losses ``[B]`` of one micro-batch, with the run's checks around the user's forward.

        In order: the guard sees the batch (buffer watch; float inputs as gradient leaves while the independence
        check is pending); with per-sample momentum, ``replay`` runs on the same batch at each stored iterate;
        ``compute_loss`` runs at the current parameters; the guard checks the buffers and (while pending) batch
        independence, then the leave-half-out forward on the batch as given.

        Args:
            batch: the micro-batch as the trainer gives it (with ``privacy_unit="user"``, a
                :class:`~lightning_dp.data.users.UserBatch`: ``compute_loss`` and ``replay`` then run on its rows
                ``[U K, ...]``, return one loss per row, and each user's loss is the weighted mean of their rows').
            batch_size: its number of examples (users with ``privacy_unit="user"``; ``None`` when it cannot be read).
            compute_loss: ``batch -> [B]`` per-sample loss of the user's step (``None``: the step skips the batch).
            replay: the same, for the extra forwards (stored iterates, leave-half-out), e.g. with logging off;
                default ``compute_loss``.
            module: the model (eval mode for the leave-half-out forwards).
            stand_in: ``batch`` is :meth:`stand_in_batch` (then clipped with ``stand_in=True``): the forwards at the
                stored iterates run with weight 0.

        Returns:
            The per-sample losses, or ``None`` when the user's step skipped the batch.

        Raises:
            UnsupportedModuleError, BatchMixingError: a check failed (see :mod:`lightning_dp.checks`).
            ValueError: on an FSDP2-sharded model, a batch whose size cannot be read, or a step that returns
                ``None`` (every rank must run every step).
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
        guarded = self._guard.before_forward(batch, batch_size)
        if state.momentum.enabled:
            self.attachment.add_past_iterates(lambda: replay(guarded), stand_in=stand_in)
        loss = compute_loss(guarded)
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
        """Whether a rank must run the forward and backward even on an empty micro-batch: on an FSDP2-sharded model
        (its collectives gather the weights around each module); run :meth:`stand_in_batch` instead."""
        state = self.state
        return state.clipper is not None and state.clipper.sharded

    def stand_in_batch(self) -> Any:
        """A one-example batch of the training data (this rank's first example, collated as the loader does, on
        the CPU), for a rank whose micro-batch is empty when :attr:`every_rank_runs_every_step`.

        Run it through :meth:`per_sample_loss` and :meth:`clip` with ``stand_in=True``, which add exactly zero (the
        forwards at per-sample momentum's iterates included): the batch keeps
        the ranks' collectives in step and carries nothing of the example (which one it is does not depend on the
        sampling).

        Raises:
            RuntimeError: before :meth:`training_loader`.
        """
        state = self.state
        if state.stand_in_source is None:
            raise RuntimeError("the training loader must be built (training_loader) before a stand-in batch")
        collate, dataset, rank = state.stand_in_source
        return collate([dataset[rank % len(dataset)]])

    def clip(self, per_sample_loss: torch.Tensor, *, stand_in: bool = False) -> torch.Tensor:
        """Add the clipped sum of this micro-batch (per-sample momentum included) into ``p.grad``; returns the
        per-sample norms ``[B]`` (see :meth:`~lightning_dp.clipping.PerSampleClipper.backward`).

        With ``stand_in`` (the loss of :meth:`stand_in_batch`, from :meth:`per_sample_loss` with ``stand_in=True``),
        the backward and its collectives run with weight 0: the clipped sum gains exactly zero and no norm is
        returned (``[0]``)."""
        state = self.state
        if stand_in:
            self._clipper.backward(per_sample_loss, weight=0.0)
            return per_sample_loss.new_zeros(0).detach()
        norms = self._clipper.backward(per_sample_loss, weight=state.momentum.current_weight)
        if state.adaptive is not None:
            state.adaptive.count(norms)
        if norms.numel():
            state.last_clip_fraction = float(self._clipper.clipped_samples(norms).float().mean())
        return norms

    def finish_run(self) -> None:
        """At the normal end of training (never on an error path: on several processes it is a collective): one
        warning when any process dropped examples with a non-finite loss or gradient, one when a due sum check was
        postponed by such examples and never ran again (docs/privacy.md, "Non-finite losses and gradients"), and one
        when a batch-independence or leave-half-out check ran inconclusively and no later batch concluded it
        (docs/privacy.md, "Run-time checks").

        The three flags are OR-ed over the ranks, and rank 0 logs; no count is kept or released.
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
    """``compute_loss`` on a user batch: the step runs on its rows ``[U K, ...]`` and each user's loss is the mean of
    their rows' (:func:`~lightning_dp.data.users.user_losses`), ``[U]``."""

    def users_loss(batch: Any) -> torch.Tensor | None:
        rows, weights = flatten_users(batch)
        loss = compute_loss(rows)
        return None if loss is None else user_losses(loss, weights)

    return users_loss
