"""The DP side of a Lightning strategy, shared by :class:`DPStrategy` (one device), :class:`DPDDPStrategy` and
:class:`DPModelParallelStrategy` (several processes, replicated or FSDP2-sharded parameters).

Lightning's strategies own devices and processes; this mixin adds, through the strategy hooks Lightning documents
(``setup_environment``, ``setup``, ``process_dataloader``, ``on_train_start``, ``training_step``, ``optimizer_step``,
``backward``, ``save_checkpoint``/``load_checkpoint``, ``teardown``), the calls into
:class:`~lightning_dp.engine.privacy_engine.PrivacyEngine` where the DP logic itself lives: Poisson sampling, per-sample
clipping, noise and accounting. It is listed before the Lightning strategy in the bases, so each hook does its DP
part and calls the strategy's own with ``super()``. On several processes it uses the collectives of
:mod:`lightning_dp.runtime.distributed` (the concrete strategy says whether there are several, in
:meth:`DPStrategyMixin._distributed_context`).
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder
from lightning.pytorch.trainer.states import RunningStage
from typing_extensions import override

from lightning_dp.config import option_docs, option_parameters, pop_options
from lightning_dp.data.batch_tensors import first_rows
from lightning_dp.engine.adapter import (
    LOSS_SCALING_REASON,
    framework_clipping,
    rank_zero_logging,
    stop_rank_zero_logging,
)
from lightning_dp.engine.exact_resume import SECRET_KEY
from lightning_dp.engine.grad_scaler import (
    handing_to_grad_scaler,
    read_finite_flags_every_step,
    scale_clipper_backward,
)
from lightning_dp.engine.physical_batches import (
    Held,
    add_gradients,
    hold_gradients,
    physical_batches,
    run_physical_batches,
    swap_gradients,
)
from lightning_dp.engine.privacy_engine import PrivacyEngine
from lightning_dp.engine.queries import PrivacyQueries
from lightning_dp.lightning.checkpoint_checks import check_loaded_checkpoint, unreadable
from lightning_dp.lightning.global_randomness import GlobalRandomness
from lightning_dp.lightning.loss_checks import check_one_loss_per_example
from lightning_dp.lightning.schedule import check_logical_steps, planned_learning_rates
from lightning_dp.optim import DPOptimizer
from lightning_dp.runtime.checkpoints import save_lightning_checkpoint
from lightning_dp.runtime.distributed import DistributedContext
from lightning_dp.utils.lightning_log_filter import drop_lightning_noise

log = logging.getLogger("lightning_dp")

_UNSUPPORTED_PRECISION = ("16-true", "transformer-engine", "transformer-engine-float16")
#: Lightning's tuners (callbacks, or added by ``Tuner``), refused: why, and what to do instead
_TUNERS = {
    LearningRateFinder: "it picks the learning rate from noiseless training losses on the private data (a search no "
    "epsilon accounts for) and rewinds the run to a checkpoint; remove it (or the Tuner call) and search with "
    "lightning_dp.tuning.private_search (docs/tuning.md)",
    BatchSizeFinder: "a batch size changed mid-run changes the sample rate the accountant assumes; remove it (or the "
    "Tuner call), set the loader's batch_size, and bound memory with max_physical_batch_size",
}
#: float16 autocast with a GradScaler: supported (docs/privacy.md, "Mixed precision")
_FP16_MIXED = ("16-mixed", "16")

# Type checkers see a Lightning strategy as the base (the hooks below override its own, marked @override, and call it
# through super()); at run time the mixin's base is a plain class, and the concrete strategy puts the Lightning
# strategy after the mixin in its bases.
if TYPE_CHECKING:
    from lightning.pytorch.strategies import Strategy as _StrategyBase
else:
    _StrategyBase = object


@contextmanager
def _logging_dropped(module: pl.LightningModule) -> Iterator[None]:
    """Within this context, ``module.log`` and ``module.log_dict`` do nothing (re-runs of a training step)."""

    def drop(*args: Any, **kwargs: Any) -> None:
        return None

    module.log, module.log_dict = drop, drop  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.log, module.log_dict


class DPStrategyMixin(PrivacyQueries, _StrategyBase):
    """Differentially private training as Lightning strategy hooks: Poisson sampling, per-sample clipping, noise,
    accounting. Combine with a Lightning strategy: ``class S(DPStrategyMixin, SomeLightningStrategy)``.

    The LightningModule's ``training_step`` must return the PER-SAMPLE loss, shape ``[B]`` (or a dict whose
    ``"loss"`` is), e.g. ``F.cross_entropy(logits, y, reduction="none")``; token losses are reduced per sample. With
    ``augmentation_multiplicity = K > 1`` the step makes and augments ``K`` copies of each of its ``B`` examples
    (:func:`lightning_dp.repeat_for_multiplicity`) and returns each example's mean over its copies, still ``[B]``
    (:func:`lightning_dp.augmentation_mean`). The rows must stay in place (rows ``i K .. i K + K - 1`` example
    ``i``'s): a reordering done only in train mode on integer inputs (token ids), inside the augmentation, is caught
    by neither check (leave-half-out runs in eval mode, integer inputs have no gradient) and nothing in this path
    compares the rows; augment with :func:`lightning_dp.augment_each_example`, which cannot move rows across examples.

    The privacy options are the fields of :class:`~lightning_dp.config.PrivacyConfig`, given as keyword arguments
    (the signature lists them); every other keyword argument goes to the Lightning strategy.

    Args:
        {options}
        kwargs: the Lightning strategy's own arguments.

    Raises:
        ValueError: invalid privacy arguments (at construction), unsupported layers (at setup), a loss that is
            not per sample (first step), ``precision="16-true"``, ``gradient_clip_val``, or Lightning's
            ``LearningRateFinder`` or ``BatchSizeFinder`` (at setup).
    """

    def __init__(self, **kwargs: Any) -> None:
        config = pop_options(kwargs)
        super().__init__(**kwargs)
        drop_lightning_noise()
        self.privacy_engine = PrivacyEngine(config)
        self._pending_loss: torch.Tensor | None = None
        self._pending_stand_in = False
        #: the parameters and the clipped sums of a micro-batch's passes before its last (max_physical_batch_size)
        self._pending_sums: tuple[list[torch.nn.Parameter], list[Held]] | None = None
        self._distributed: DistributedContext | None = None
        self._log_filter: logging.Filter | None = None
        self._global_randomness = GlobalRandomness()  # with exact_resume
        self._privacy_entry: Any = None  # the privacy state loaded last (its checkpoint's "lightning_dp" entry)

    @property
    def poisson_sampling(self) -> bool:
        """Whether the training loader Poisson-samples (the ``poisson_sampling`` option)."""
        return self.privacy_engine.config.poisson_sampling

    def read_batch_size(self, batch: Any) -> int | None:
        """:func:`~lightning_dp.data.batch_tensors.first_rows` (``None`` when unreadable); the
        :class:`~lightning_dp.engine.adapter.TrainerAdapter` method. Not Lightning's ``extract_batch_size``, which warns
        on a batch holding other sizes (a name per example, a 0-dim tensor) with the size found in the message: a new
        warning at each new size the draws give."""
        return first_rows(batch)

    def _distributed_context(self) -> DistributedContext | None:
        """The process group the DP collectives run over; ``None`` (one process) unless a strategy says otherwise."""
        return None

    # ------------------------------------------------------------------------------------------------ setup
    @override
    def setup_environment(self) -> None:
        """Start the processes as Lightning does, then begin the fit (``PrivacyEngine.begin_fit``: join the run to the
        processes) before any hook can build the training loader (a module's ``setup`` or ``configure_optimizers``
        reading ``estimated_stepping_batches``) and before the checkpoint is loaded."""
        super().setup_environment()
        if self.lightning_module is not None and self.lightning_module.trainer.state.fn == "fit":
            self.privacy_engine.begin_fit(self._distributed_context())

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """Check the trainer configuration, set up as Lightning does, then attach clipping hooks in place (on several
        processes only rank 0 keeps logging)."""
        self._distributed = self._distributed_context()
        self._log_filter = rank_zero_logging(self._distributed, self._log_filter)
        precision = str(getattr(self.precision_plugin, "precision", trainer.precision))
        scaler = getattr(self.precision_plugin, "scaler", None)
        if precision in _UNSUPPORTED_PRECISION or (scaler is not None and precision not in _FP16_MIXED):
            raise ValueError(
                f"precision={precision!r} is not supported by {type(self).__name__} ({LOSS_SCALING_REASON}); use "
                "precision='16-mixed', 'bf16-mixed' or '32-true'"
            )
        if framework_clipping(trainer.gradient_clip_val) != "none":  # no framework default to switch off
            raise ValueError(
                "gradient_clip_val is redundant with DP per-sample clipping: remove it and set "
                f"{type(self).__name__}(max_grad_norm=...)"
            )
        for tuner, why in _TUNERS.items() if trainer.state.fn == "fit" else ():
            for callback in [callback for callback in trainer.callbacks if isinstance(callback, tuner)]:
                if getattr(callback, "_early_exit", False):  # added by Tuner, which leaves it there on an error
                    trainer.callbacks.remove(callback)
                raise ValueError(f"{type(self).__name__} does not support Lightning's {tuner.__name__}: {why}")
        super().setup(trainer)
        if trainer.state.fn == "fit":
            if not self.lightning_module.automatic_optimization:
                raise ValueError(
                    f"{type(self).__name__} supports automatic optimization only; remove automatic_optimization=False"
                )
            autocast = self.precision_plugin.train_step_context  # the probe's forward runs in it, as training's do
            self.privacy_engine.start_run(self.lightning_module, self._distributed, autocast)
            if precision in _FP16_MIXED:
                scale_clipper_backward(self.privacy_engine)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """The training loader of the run (:meth:`~lightning_dp.engine.privacy_engine.PrivacyEngine.training_loader`:
        Poisson sampling of this rank's shard at the global rate q); other stages are untouched."""
        trainer = self.lightning_module.trainer
        if trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        batch_size = getattr(dataloader, "batch_size", None) or getattr(
            getattr(dataloader, "batch_sampler", None), "batch_size", None
        )
        return self.privacy_engine.training_loader(
            dataloader, batch_size=batch_size, micro_batches=trainer.accumulate_grad_batches
        )

    @override
    def on_train_start(self) -> None:
        """Fix delta, calibrate the noise for the planned steps, build the accountant, wrap the optimizers
        (:meth:`~lightning_dp.engine.privacy_engine.PrivacyEngine.start_training`; on several processes the ranks must
        agree on N, q and the noise, and the clipped sums are SUM all-reduced).

        Raises:
            ValueError: with ``accumulate_grad_batches = k > 1``, when an epoch's batch count is not a multiple of
                k (e.g. ``limit_train_batches``) or training resumes in the middle of a logical step: either would
                make an optimizer step from part of a Poisson sample (or from two), which the accountant cannot
                describe.
        """
        super().on_train_start()
        trainer = self.lightning_module.trainer
        check_logical_steps(trainer)
        estimate = trainer.estimated_stepping_batches
        planned = int(estimate) if math.isfinite(estimate) else None
        correlated = self.privacy_engine.config.noise_correlation is not None
        rates = planned_learning_rates(trainer, planned) if planned and correlated else None  # its strategy's workload
        self.optimizers = self.privacy_engine.start_training(self.optimizers, total_steps=planned, learning_rates=rates)
        self._global_randomness.started()

    # ------------------------------------------------------------------------------------------- the step
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the user's step through the engine's per-sample loss sequence (guard, per-sample momentum,
        independence checks), keep its per-sample loss for clipping, hand Lightning its mean for logging.

        The extra runs of the user's step (at the stored iterates of per-sample momentum, and the leave-half-out
        forwards) have ``self.log`` / ``self.log_dict`` switched off. With ``max_physical_batch_size`` the step runs
        once per pass of at most that many examples (:mod:`lightning_dp.engine.physical_batches`), every pass but the
        last clipped here, and the returned loss is the mean over all the passes' examples.
        """
        engine = self.privacy_engine
        if engine.budget_exhausted():
            return None
        # passes of at most max_physical_batch_size examples; on a sharded model a rank with an empty batch (or fewer
        # passes) joins the step's collectives on a stand-in batch that adds zero
        passes = physical_batches(self, args[0] if args else kwargs.get("batch"), self.batch_to_device)
        step = super().training_step
        outputs: list[Any] = []

        def run(on: Any) -> Any:
            if args:
                call_args, call_kwargs = (on, *args[1:]), kwargs
            else:
                call_args, call_kwargs = args, {**kwargs, "batch": on} if "batch" in kwargs else kwargs
            return step(*call_args, **call_kwargs), call_args, call_kwargs

        def current(on: Any) -> torch.Tensor | None:
            output, call_args, call_kwargs = run(on)
            outputs.append(output)
            return self._per_sample_loss(output, call_args, call_kwargs)

        def replay(on: Any) -> torch.Tensor | None:
            with _logging_dropped(self.lightning_module):
                return self._per_sample_loss(*run(on))

        def forward(batch: Any, size: int | None, stand_in: bool) -> torch.Tensor | None:
            return engine.per_sample_loss(
                batch, size, current, replay=replay, module=self.lightning_module, stand_in=stand_in
            )

        # every pass but the last is clipped here, apart from p.grad (which Lightning zeroes between this step and its
        # backward on a logical step's first micro-batch); the last one's loss goes to Lightning's backward
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        held = hold_gradients(params) if len(passes) > 1 else None
        engine.start_batch()
        done = run_physical_batches(passes, forward, engine.clip, defer_last=True)
        if held is not None:
            self._pending_sums = (params, swap_gradients(params, held))
        output = outputs[-1]
        if done.deferred is None and held is None:
            return output
        if done.deferred is not None:
            self._pending_loss, self._pending_stand_in = done.deferred
        reduced = done.mean(self.root_device)  # over the micro-batch's examples, for logging
        return {**output, "loss": reduced} if isinstance(output, Mapping) else reduced

    def _per_sample_loss(self, output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
        """The per-sample loss ``[B]`` in the user's step output (None when the step skips the batch).

        Raises:
            ValueError: a loss that is not of shape ``[B]``, or not one entry per example.
        """
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if loss is None:
            return None
        if not isinstance(loss, torch.Tensor) or loss.ndim != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"training_step must return a per-sample loss of shape [B], got {shape}: use reduction='none' "
                "(and reduce token losses per sample) so each example can be clipped"
            )
        size = self.read_batch_size(args[0] if args else kwargs.get("batch"))
        check_one_loss_per_example(size, loss, self.privacy_engine.config)
        return loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        """Add the noise right after the closure, before ``on_before_optimizer_step`` hooks can read gradients."""
        if isinstance(optimizer, DPOptimizer):
            closure = optimizer.privatising(closure)
            scaler = getattr(self.precision_plugin, "scaler", None)
            if scaler is not None:  # 16-mixed: the scaler's unscale_ must give the noised gradient back
                read_finite_flags_every_step(optimizer)
                closure = handing_to_grad_scaler(closure, lambda: optimizer.params, scaler, optimizer.should_skip)
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    @override
    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Per-sample clipping instead of a plain backward: the clipped SUM is accumulated into ``p.grad``."""
        if self._pending_loss is None and self._pending_sums is None:
            raise RuntimeError("backward() without a per-sample loss from training_step")
        per_sample_loss, self._pending_loss = self._pending_loss, None
        sums, self._pending_sums = self._pending_sums, None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        if per_sample_loss is not None:
            self.privacy_engine.clip(per_sample_loss, stand_in=self._pending_stand_in)
        if sums is not None:  # the clipped sums of the step's earlier passes (training_step)
            add_gradients(*sums)
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    # ---------------------------------------------------------------------------------------- checkpoints
    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Add the privacy state (ledger, mechanism, filter state; with ``exact_resume`` the secret state, but not in a
        weights-only checkpoint, which cannot resume) under ``checkpoint["lightning_dp"]``."""
        trainer = self.lightning_module.trainer
        if self.privacy_engine.checkpoint.load_is_partial and trainer.interrupted and trainer.state.stage is not None:
            log.warning("%s not written: a checkpoint's load into this run did not finish", filepath)
            return  # OnExceptionCheckpoint in a fit its load broke: the error that stopped the fit is the one raised
        if self.privacy_engine.accountant is not None:
            entry = checkpoint["lightning_dp"] = self.privacy_engine.state_dict()
            if "optimizer_states" not in checkpoint:  # weights only: the file users release
                entry.pop(SECRET_KEY, None)
            elif SECRET_KEY in entry:  # exact_resume: the model's own randomness too
                self._global_randomness.save(entry[SECRET_KEY], self.root_device, self._distributed)
        self._write_checkpoint(checkpoint, filepath, storage_options)

    def _write_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any) -> None:
        """Write ``checkpoint`` as the Lightning strategy does, atomically for a local file written by rank 0
        (:func:`~lightning_dp.runtime.checkpoints.save_lightning_checkpoint`); a strategy with its own format (sharded
        checkpoints) overrides this."""
        save_lightning_checkpoint(self, checkpoint, filepath, storage_options, super().save_checkpoint)  # atomic

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load as Lightning does and restore the privacy state, so resuming continues the epsilon curve.

        Raises:
            ValueError: the file cannot be read (truncated or corrupted); what
                :func:`~lightning_dp.lightning.checkpoint_checks.check_loaded_checkpoint` refuses (a load while
                training runs, a resume without privacy state); the privacy state is malformed or does not match this
                run (see :meth:`~lightning_dp.engine.privacy_engine.PrivacyEngine.load_state_dict`).
        """
        try:
            checkpoint = super().load_checkpoint(
                checkpoint_path, weights_only=False if weights_only is None else weights_only
            )
        except Exception as error:  # noqa: BLE001 - torch.load fails in many ways on damaged files (zip, pickle, EOF)
            raise unreadable(checkpoint_path, error) from error
        fitting = self.lightning_module.trainer.state.fn == "fit"
        training = any(isinstance(optimizer, DPOptimizer) for optimizer in self.optimizers)
        resuming = checkpoint.get("global_step", 0) > 0 and fitting
        check_loaded_checkpoint(checkpoint, checkpoint_path, resuming=resuming, training=training)
        self._privacy_entry = None
        if "lightning_dp" not in checkpoint:  # Lightning loads its weights next (load_model_state_dict)
            self.privacy_engine.checkpoint.begin_load()
            return checkpoint
        entry = checkpoint["lightning_dp"]  # checked before the engine's state changes: a refused load changes nothing
        secret = (entry.get(SECRET_KEY) if isinstance(entry, dict) else None) or {}
        restore_randomness = self.privacy_engine.config.exact_resume and fitting and isinstance(secret, dict)
        if restore_randomness:
            GlobalRandomness.check(secret)
        self.privacy_engine.load_state_dict(entry, weights_follow=True)
        if restore_randomness:
            self._global_randomness.restore(secret, self.root_device, self.global_rank, self.world_size)
        self._privacy_entry = entry
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Load the weights as Lightning does: those of the checkpoint whose privacy state was loaded in
        ``CheckpointState.loading_weights``, others (a checkpoint without privacy state, or one Lightning kept from an
        earlier load and applies again) as a partial load (``CheckpointState.begin_load``)."""
        if self._privacy_entry is None or checkpoint.get("lightning_dp") is not self._privacy_entry:
            self.privacy_engine.checkpoint.begin_load()
            return super().load_model_state_dict(checkpoint, strict=strict)
        with self.privacy_engine.checkpoint.loading_weights(self.lightning_module):
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def on_train_end(self) -> None:
        """The engine's end-of-run report (``PrivacyEngine.finish_run``), at the normal end of training only."""
        self.privacy_engine.finish_run()
        super().on_train_end()

    @override
    def teardown(self) -> None:
        """Unwrap the optimizers and detach the clipping hooks (the module is exactly as before)."""
        self.optimizers = [getattr(opt, "original_optimizer", opt) for opt in self.optimizers]
        try:
            self.privacy_engine.detach()
        finally:
            stop_rank_zero_logging(self._log_filter)
            self._log_filter = None
            super().teardown()


# The options as explicit keyword parameters and documented arguments, derived from PrivacyConfig (LightningCLI and
# help() read both; the body passes every other keyword argument on to the Lightning strategy).
DPStrategyMixin.__doc__ = DPStrategyMixin.__doc__.replace(" " * 8 + "{options}", option_docs(indent=8))
DPStrategyMixin.__init__.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        *option_parameters(),
        inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD, annotation=Any),
    ]
)
