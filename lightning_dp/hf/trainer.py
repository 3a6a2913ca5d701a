"""``DPTrainer``: differentially private training with the HuggingFace ``Trainer``, over the same ``PrivacyEngine``.

A thin adapter like :class:`~lightning_dp.lightning.DPStrategy`: sampling, clipping, noise and accounting live in
:class:`~lightning_dp.engine.privacy_engine.PrivacyEngine`, :class:`~lightning_dp.optim.DPOptimizer` and
:mod:`lightning_dp.data`. The model is never wrapped: clipping hooks are attached in place during
:meth:`DPTrainer.train` only, so ``generate`` and ``save_pretrained`` work unchanged. Which ``Trainer`` methods are
overridden and why: docs/design.md section 12.1; the private ones for sharded checkpoints are listed in
:data:`lightning_dp.hf.sharded_checkpoints.PRIVATE_TRAINER_OVERRIDES`.

One logical step is ``gradient_accumulation_steps`` micro-batches forming ONE Poisson sample of rate ``q =
per_device_train_batch_size * gradient_accumulation_steps * world_size / N``; ``epsilon`` (at ``target_delta``) is
added to every log. Privacy state is saved beside each checkpoint (:mod:`lightning_dp.hf.callbacks`).

Not supported (rejected at construction): reentrant activation checkpointing, DeepSpeed, FSDP
through ``TrainingArguments`` or accelerate plugins set up outside DPTrainer, DataParallel, ``torch_compile``,
``auto_find_batch_size``, ``include_num_input_tokens_seen``, ``neftune_noise_alpha``, ``model_init``,
``compute_loss_func``, models sharded by
``from_pretrained(distributed_config=...)``. FSDP2 models (``fully_shard`` by the user, or accelerate's FSDP2
configuration, :mod:`lightning_dp.hf.accelerate_fsdp`) are supported: docs/design.md section 8.1. Several processes
(``accelerate launch``, ``torchrun``): docs/design.md section 8 and section 12.1.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import torch
from accelerate import PartialState
from torch import nn
from torch.utils.data import DataLoader
from transformers import Trainer
from typing_extensions import override

from lightning_dp.data.batch_tensors import leading_rows
from lightning_dp.data.users import read_user_ids
from lightning_dp.engine.accounting import summary_metrics
from lightning_dp.engine.adapter import rank_zero_logging
from lightning_dp.engine.grad_scaler import (
    hand_skipped_step_to_grad_scaler,
    hand_to_grad_scaler,
    read_finite_flags_every_step,
    scale_clipper_backward,
)
from lightning_dp.engine.physical_batches import physical_batches, run_physical_batches
from lightning_dp.engine.queries import PrivacyQueries
from lightning_dp.engine.workload import scheduled_learning_rates, stand_in_optimizer
from lightning_dp.hf.accelerate_fsdp import fsdp2_settings_from_launcher, hidden_from_accelerate, shard_as_configured
from lightning_dp.hf.arguments import HF_NAMING, PrivacyArguments
from lightning_dp.hf.augmentation_copies import check_augmentation, mean_loss_over_copies
from lightning_dp.hf.callbacks import PRIVACY_STATE_NAME, PrivacyBudget, PrivacyStateCallback, load_privacy_state
from lightning_dp.hf.losses import head_per_example_loss
from lightning_dp.hf.sampling import poisson_batch_lengths
from lightning_dp.hf.sharded_checkpoints import ShardedCheckpoints
from lightning_dp.hf.trainer_checks import (
    check_accelerator_and_model,
    check_model_and_loss,
    check_resume_skips_no_batches,
    check_sharded_run,
    check_trainer_neftune,
    check_training_arguments,
    warn_ignored_without_dp,
)
from lightning_dp.optim import DPOptimizer
from lightning_dp.runtime.checkpoints import last_complete_checkpoint
from lightning_dp.runtime.distributed import DistributedContext, distributed_context
from lightning_dp.runtime.sharding import uses_fsdp

log = logging.getLogger("lightning_dp")


class DPTrainer(PrivacyQueries, ShardedCheckpoints, Trainer):
    """``transformers.Trainer`` with differentially private training (DP-SGD: Abadi et al. 2016, Algorithm 1).

    Per-example losses are formed for causal and seq2seq LM, token, sequence, image and audio classification heads
    (:mod:`lightning_dp.hf.losses`); override :meth:`compute_per_example_loss` for another head. With
    ``augmentation_multiplicity = K > 1`` (De et al. 2022, Section 3.2) the batch is repeated ``K`` times, augmented by
    :meth:`augment_copies` (a subclass must override it), and each example's mean loss over its copies is clipped once
    (docs/design.md section 4.8).

    Args:
        *args: the ``Trainer``'s positional arguments.
        privacy_args: the privacy configuration.
        **kwargs: the ``Trainer``'s keyword arguments (``model``, ``args``, ``train_dataset``, ``data_collator``...).

    Attributes:
        privacy_engine: the run's :class:`~lightning_dp.engine.privacy_engine.PrivacyEngine`.
        last_clip_fraction: fraction of the last clipped pass's examples whose gradient norm exceeded
            ``max_grad_norm`` (diagnostic only: not privatised, so not logged).

    Raises:
        ValueError: an unsupported configuration (module docstring) or ``TrainingArguments.max_grad_norm`` other than
            0 or its default; a head without per-example loss; an unsupported trainable layer
            (``UnsupportedModuleError``); ``augmentation_multiplicity > 1`` without an overridden
            :meth:`augment_copies`.
    """

    def __init__(self, *args: Any, privacy_args: PrivacyArguments, **kwargs: Any) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        engine = privacy_args.make_privacy_engine()  # validates the privacy arguments, also with disable_dp
        #: accelerate's FSDP2 settings, taken over: the model is sharded here, the Accelerator built without them.
        self._fsdp_settings = None if privacy_args.disable_dp else fsdp2_settings_from_launcher()
        if training_args is not None and not privacy_args.disable_dp:
            check_training_arguments(training_args, privacy_args)
        model = kwargs.get("model", args[0] if args else None)
        if self._fsdp_settings is not None and model is not None and not uses_fsdp(model):
            device = training_args.device if training_args is not None else PartialState().device
            shard_as_configured(model, self._fsdp_settings, device)
        super().__init__(*args, **kwargs)
        self.privacy_args = privacy_args
        self.privacy_engine = engine
        self._dp_optimizer: DPOptimizer | None = None
        self._distributed: DistributedContext | None = None
        self._log_filter: logging.Filter | None = None
        if privacy_args.disable_dp:
            warn_ignored_without_dp(engine.config)
            return
        if training_args is None:
            check_training_arguments(self.args, privacy_args)
        check_accelerator_and_model(
            self.model, deepspeed_enabled=self.is_deepspeed_enabled, fsdp_enabled=self.is_fsdp_enabled
        )
        custom = type(self).compute_per_example_loss is not DPTrainer.compute_per_example_loss
        self._head = check_model_and_loss(self.model, self.model_init, self.compute_loss_func, self.label_names, custom)
        augment = type(self).augment_copies is not DPTrainer.augment_copies
        check_augmentation(engine.config.augmentation_multiplicity, augment)
        # Fail now on unsupported trainable layers; the hooks live only while train() runs.
        with HF_NAMING.applied():  # a refused option is named as in PrivacyArguments
            self.privacy_engine.attach(self.model, self.accelerator.autocast)  # the probe under the run's autocast
        self.privacy_engine.detach()
        self.add_callback(PrivacyStateCallback(self.privacy_engine))

    @override
    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's; under accelerate's FSDP2 settings (the model already sharded by DPTrainer), the
        Accelerator is built without them, so that it neither shards the model again nor reduces its gradients."""
        if self._fsdp_settings is None:
            super().create_accelerator_and_postprocess()
            return
        with hidden_from_accelerate():
            super().create_accelerator_and_postprocess()

    @override
    def get_epsilon(self, delta: float | None = None) -> float:
        """As :meth:`PrivacyQueries.get_epsilon <lightning_dp.engine.queries.PrivacyQueries.get_epsilon>`; ``inf``
        with ``disable_dp`` (no guarantee)."""
        return math.inf if self.privacy_args.disable_dp else super().get_epsilon(delta)

    @override
    def privacy_summary(self) -> dict[str, Any]:
        """As :meth:`PrivacyQueries.privacy_summary <lightning_dp.engine.queries.PrivacyQueries.privacy_summary>`.

        Raises:
            RuntimeError: before training started, or with ``disable_dp`` (no privacy state).
        """
        if self.privacy_args.disable_dp:
            raise RuntimeError("disable_dp=True: this run trains without differential privacy and has no privacy state")
        return super().privacy_summary()

    def read_batch_size(self, batch: dict[str, Any]) -> int | None:
        """The rows of the batch's first tensor (:func:`~lightning_dp.data.batch_tensors.leading_rows`; ``None``
        without one); the :class:`~lightning_dp.engine.adapter.TrainerAdapter` method."""
        return leading_rows(batch)

    # --------------------------------------------------------------------------------------------- training
    @override
    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        """``Trainer.train`` with the clipping hooks attached and, on resume, the checkpoint's privacy state restored.

        Raises:
            ValueError: what :func:`~lightning_dp.hf.trainer_checks.check_training_arguments` refuses in the
                arguments as they are now; on a sharded model, what
                :func:`~lightning_dp.hf.trainer_checks.check_sharded_run` refuses; a
                checkpoint without privacy state, or one (or, sharded, whose shards) not matching this run; a sample
                rate different from the checkpoint's.
            FileNotFoundError: a sharded model's checkpoint without its ``sharded_state`` folder.
        """
        if self.privacy_args.disable_dp:
            log.warning(
                "disable_dp=True: training WITHOUT differential privacy (the plain Trainer's training); no privacy "
                "guarantee holds, and epsilon is reported as inf"
            )
            return super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
        check_training_arguments(self.args, self.privacy_args)  # again: the arguments can change after construction
        check_trainer_neftune(getattr(self, "neftune_noise_alpha", None))
        engine = self.privacy_engine
        engine.begin_fit(distributed_context())
        if uses_fsdp(self.model):
            check_sharded_run(self.args)
        if resume_from_checkpoint is True:
            resume_from_checkpoint = last_complete_checkpoint(self.args.output_dir, PRIVACY_STATE_NAME)
            if resume_from_checkpoint is None:
                raise ValueError(f"No valid checkpoint found in output directory ({self.args.output_dir})")
        if resume_from_checkpoint:
            check_resume_skips_no_batches(self.args, engine.config)
            with HF_NAMING.applied():  # a checkpoint that does not match names the PrivacyArguments that differ
                load_privacy_state(engine, resume_from_checkpoint)
        self._distributed = distributed_context()
        self._log_filter = rank_zero_logging(self._distributed, self._log_filter)  # kept after train()
        if self._distributed is not None:
            self._distributed.broadcast_module(self.model)
        # Never DistributedDataParallel: accelerate's switch that skips the DDP/FSDP wrapping (module docstring).
        accelerator = self.accelerator
        prepare_model = type(accelerator).prepare_model
        accelerator.prepare_model = functools.partial(prepare_model, accelerator, evaluation_mode=True)
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, PrivacyBudget):
                callback.bind(engine)
        with HF_NAMING.applied():
            engine.start_run(self.model, self._distributed, accelerator.autocast)  # probed under the run's autocast
        wrapped = getattr(self.optimizer, "optimizer", self.optimizer)  # inside accelerate's wrapper, if any
        if isinstance(wrapped, DPOptimizer):  # a second train(): wrapped afresh, so that training starts again
            self.optimizer = wrapped.original_optimizer
        if self.args.fp16 or accelerator.mixed_precision == "fp16":
            scale_clipper_backward(engine)
        try:
            result = super().train(resume_from_checkpoint=resume_from_checkpoint or None, **kwargs)
            engine.finish_run()
            return result
        finally:
            engine.detach()

    @override
    def hyperparameter_search(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: the Trainer's search trains a candidate per trial on the private data and keeps the best by its
        evaluation, a search no epsilon accounts for.

        Raises:
            ValueError: always; ``lightning_dp.tuning.private_search`` accounts for a search (docs/tuning.md).
        """
        raise ValueError(
            "DPTrainer does not support hyperparameter_search (its trials are a search on the private data that no "
            "epsilon accounts for): search with lightning_dp.tuning.private_search (docs/tuning.md)"
        )

    @override
    def get_train_dataloader(self) -> DataLoader:
        """The Trainer's loader drawing Poisson batches of this rank's shard at the global rate q.

        ``train_sampling_strategy="group_by_length"`` splits each Poisson batch into micro-batches of similar lengths;
        strategies other than ``"random"`` are ignored with a warning (:mod:`lightning_dp.hf.sampling`).

        Raises:
            ValueError: the training set changed size between calls; ``poisson_sampling=False`` on several processes.
            TypeError: an iterable dataset (Poisson sampling needs ``__len__``).
        """
        if self.privacy_args.disable_dp:
            return super().get_train_dataloader()
        loader = super().get_train_dataloader()
        lengths = None
        if self.privacy_engine.config.poisson_sampling:  # else the Trainer's own sampler applies its strategy
            # the dataset as given (the loader's has lost the columns the model does not take, the length one too)
            processing_class = self.processing_class if hasattr(self, "processing_class") else self.tokenizer
            lengths = poisson_batch_lengths(self.args, self.train_dataset, processing_class)
        config = self.privacy_engine.config
        user_ids = None
        if config.privacy_unit == "user":  # read from the dataset as given: the loader's lost the columns the model
            user_ids = read_user_ids(self.train_dataset, config.user_key)  # does not take, the user column among them
        return self.privacy_engine.training_loader(
            loader,
            batch_size=self.args.per_device_train_batch_size,
            micro_batches=self.args.gradient_accumulation_steps,
            lengths=lengths,
            user_ids=user_ids,
        )

    @override
    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer wrapped in a ``DPOptimizer`` once the engine is prepared for the planned steps.

        Raises:
            RuntimeError: called outside :meth:`train`; ranks that disagree on the dataset size, sample rate or noise.
            ValueError: an optimizer from ``optimizers=(optimizer, scheduler)`` updates tensors that are not the model's
                parameters (their gradients would never be clipped).
        """
        optimizer = super().create_optimizer(model)
        if self.privacy_args.disable_dp:
            return optimizer
        if isinstance(optimizer, DPOptimizer) or isinstance(getattr(optimizer, "optimizer", None), DPOptimizer):
            return optimizer
        if self.sample_rate is None:
            raise RuntimeError("DPTrainer creates its optimizer inside train(), once the training data is known")
        planned = self.state.max_steps if self.state.max_steps and self.state.max_steps > 0 else None
        correlated = self.privacy_engine.config.noise_correlation is not None
        rates = self._planned_learning_rates(optimizer, planned) if planned and correlated else None
        (self._dp_optimizer,) = self.privacy_engine.start_training(
            [optimizer], total_steps=planned, learning_rates=rates
        )
        self.optimizer = self._dp_optimizer
        return self.optimizer

    def _planned_learning_rates(self, optimizer: torch.optim.Optimizer, steps: int) -> tuple[float, ...] | None:
        """The learning rate of each planned step (the workload of correlated noise): the schedule of the scheduler
        ``create_scheduler`` makes (or of the one given in ``optimizers=``), read on a stand-in optimizer
        (:func:`~lightning_dp.engine.workload.scheduled_learning_rates`); the Trainer's own scheduler is made later."""
        kept = self.lr_scheduler, getattr(self, "_created_lr_scheduler", False)
        try:
            stand_in = stand_in_optimizer(optimizer)
            scheduler = self.create_scheduler(steps, optimizer=stand_in)
        except Exception as error:  # a user's create_scheduler: its schedule is then not known here
            log.info("the learning-rate schedule could not be read (%s): C is optimised for a constant rate", error)
            return None
        finally:
            self.lr_scheduler, self._created_lr_scheduler = kept
        if scheduler is not kept[0] and getattr(scheduler, "optimizer", None) is not stand_in:
            return None  # a create_scheduler that made its scheduler on another optimizer
        return scheduled_learning_rates(scheduler, steps)

    def compute_per_example_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """One loss per example, ``[B]``, for the model's head (override for other heads).

        Token losses are reduced per example by ``PrivacyArguments.per_example_reduction``;
        ``TrainingArguments.label_smoothing_factor`` applies to cross-entropy heads.

        Args:
            model: the (training) model.
            inputs: the batch on the device, with ``labels``.

        Returns:
            ``[B]`` per-example losses, attached to the graph.

        Raises:
            ValueError: the batch has no ``labels``.
        """
        reduction, smoothing = self.privacy_args.per_example_reduction, self.args.label_smoothing_factor
        config = getattr(self.model, "config", None)  # a classifier's problem_type, read after the forward
        return head_per_example_loss(model, inputs, self._head, reduction, label_smoothing=smoothing, config=config)

    def augment_copies(self, inputs: dict[str, Any]) -> dict[str, Any]:
        """Augment the copies of a batch, row by row (override when ``augmentation_multiplicity = K > 1``).

        Called in train mode on the batch repeated ``K`` times in sample-major order (``[B K, ...]``: rows ``i K .. i K
        + K - 1`` are example ``i``'s, labels included). Each row must be augmented from that row alone (no other
        example, no batch statistics) and stay in place; :func:`lightning_dp.augment_each_example` does so. Draw
        randomness from torch's global RNG only (seeded by the Trainer's ``seed``): a generator of your own makes the
        re-runs of per-sample momentum and the checks differ, and the run is refused. Why, and what the row checks
        cannot see: docs/design.md section 4.8.

        Args:
            inputs: the copies, ``{name: [B K, ...]}``.

        Returns:
            The augmented copies, the same keys and row count.

        Raises:
            ValueError: (raised by DPTrainer after the call) ``labels`` changed, or a row moved across examples.
        """
        return inputs

    def _per_example_loss(self, model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        """``[B]``: :meth:`compute_per_example_loss`, or with ``augmentation_multiplicity = K > 1`` each example's
        mean over the losses of its ``K`` (augmented) copies (De et al. 2022, Section 3.2)."""
        copies = self.privacy_engine.config.augmentation_multiplicity
        if copies == 1:
            return self.compute_per_example_loss(model, inputs)
        return mean_loss_over_copies(model, inputs, copies, self.compute_per_example_loss, self.augment_copies)

    @override
    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """Forward, per-example losses, clipping into ``p.grad``; noise once, on a logical step's last micro-batch.

        With ``max_physical_batch_size`` the micro-batch runs in passes of at most that many examples, each clipped
        into ``p.grad`` before the next forward (:mod:`lightning_dp.engine.physical_batches`). Returns the micro-batch's
        mean loss over all its passes divided by ``gradient_accumulation_steps`` (0 for an empty Poisson batch).
        ``num_items_in_batch`` is ignored: the gradient is divided by ``q N`` (docs/design.md section 3.2).

        Raises:
            RuntimeError: a logical step of a number of micro-batches other than ``gradient_accumulation_steps``.
        """
        if self.privacy_args.disable_dp:
            return super().training_step(model, inputs, num_items_in_batch)
        engine = self.privacy_engine
        engine.count_micro_batch()
        exhausted = engine.budget_exhausted()
        loss = torch.zeros((), device=self.args.device)
        if exhausted:
            self.control.should_training_stop = True
        else:
            model.train()

            def compute(batch: dict[str, Any]) -> torch.Tensor:
                with self.compute_loss_context_manager():
                    return self._per_example_loss(model, batch)

            def forward(batch: dict[str, Any], size: int | None, stand_in: bool) -> torch.Tensor:
                batch = self._prepare_inputs(batch)
                if size == 0:
                    return torch.zeros(0, device=self.args.device)
                losses = engine.per_sample_loss(batch, size, compute, module=model, stand_in=stand_in)
                if losses is None:
                    raise TypeError("compute_per_example_loss returned None: return the per-example losses, shape [B]")
                return losses

            # passes of at most max_physical_batch_size examples; on a sharded model a rank with an empty batch (or
            # fewer passes) joins the step's collectives on a stand-in batch that adds zero
            passes = physical_batches(self, inputs)
            engine.start_batch()
            loss = run_physical_batches(passes, forward, engine.clip, defer_last=False).mean(loss.device)
        if self.accelerator.sync_gradients:
            engine.end_logical_step(self.args.gradient_accumulation_steps)
            scaler, params = self.accelerator.scaler, self._dp_optimizer.params
            if scaler is not None:
                read_finite_flags_every_step(self._dp_optimizer)
            if not exhausted:
                self._dp_optimizer.privatise()
                if scaler is not None:  # fp16: its unscale_ must give the noised gradient back
                    hand_to_grad_scaler(params, scaler)
            elif scaler is not None:  # the budget is spent: accelerate's scaler step still runs, DPOptimizer skips
                hand_skipped_step_to_grad_scaler(params, scaler)
        return loss / self.args.gradient_accumulation_steps

    @override
    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """0, so that ``total_flos`` stays 0: the Trainer's count (``6 x`` the micro-batch's tokens ``x`` the
        parameters, summed over the run) counts the sampled examples' tokens, which it would log and save in every
        checkpoint's ``trainer_state.json`` without noise (docs/privacy.md)."""
        return 0

    @override
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """``Trainer.log`` with ``epsilon`` added once training has started, and the privacy summary (``dp/epsilon``,
        ``dp/delta``, ``dp/noise_multiplier``, ``dp/steps``...) added to the end-of-training log.
        """
        engine = self.privacy_engine
        if self.privacy_args.disable_dp:
            logs["epsilon"] = math.inf
        elif engine.accountant is not None:
            logs["epsilon"] = engine.epsilon()
            if engine.adaptive is not None:  # the bound the next step clips at (a released value)
                logs["dp/max_grad_norm"] = engine.current_max_grad_norm
            if "train_runtime" in logs:
                summary = engine.summary()
                logs.update({f"dp/{k}": v for k, v in summary_metrics(summary).items()})
        super().log(logs, start_time)
