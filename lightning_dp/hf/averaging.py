"""Parameter averaging for the HuggingFace ``Trainer``: an exponential moving average (EMA) of the trainable weights.

De et al. 2022, "Unlocking high-accuracy differentially private image classification through scale", section 3.
The averaged iterates are the released ones, so the average is post-processing: the accountant is unchanged. The rule:
train on the iterate; evaluate and checkpoint with the average (a checkpoint's model files hold it, and
:data:`AVERAGING_STATE_NAME` holds the other tensors, so a resume continues both exactly); end with the average.
When exactly the weights are exchanged: docs/design.md section 12.1. (Lightning: use its ``EMAWeightAveraging``.)
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.hooks import RemovableHandle
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from typing_extensions import override

from lightning_dp.hf.callbacks import checkpoint_folder, load_checkpoint_tensors, written_checkpoint_folder
from lightning_dp.runtime.checkpoints import atomic_save
from lightning_dp.runtime.sharding import uses_fsdp

#: File holding the averaging state in each Trainer checkpoint folder: ``parameter_names``, ``averaged_model_state``
#: (the ``AveragedModel``'s state dict: its tensors and ``n_averaged``), ``model_files_hold_average`` (when True,
#: the checkpoint's model files hold the average and ``averaged_model_state``'s tensors the training iterate) and
#: ``model_files_fingerprint`` (the float64 sum of each averaged tensor in the model files, checked on resume).
AVERAGING_STATE_NAME = "lightning_dp_averaging.pt"


class ParameterAveraging(TrainerCallback):
    """An exponential moving average of the trainable parameters, for ``DPTrainer`` and the plain ``Trainer``.

    After optimizer step ``t`` (one logical step), ``A_1 = W_1`` and ``A_t = decay * A_{t-1} + (1 - decay) * W_t``
    (:func:`torch.optim.swa_utils.get_ema_multi_avg_fn`); a step the optimizer did not take is not averaged. Only
    parameters with ``requires_grad`` are averaged (buffers are not: the model keeps its own); each average has its
    parameter's dtype, so keep trainable parameters in float32 (in bf16 a ``decay`` close to 1 loses small updates).
    Use ``DPTrainer(callbacks=[ParameterAveraging(0.999)])``; outside the Trainer's schedule use
    :meth:`averaged_weights`.

    Not supported: models sharded across processes (FSDP, DeepSpeed); resuming from a checkpoint outside
    ``args.output_dir``.

    Args:
        decay: weight of the previous average per optimizer step, in (0, 1) (dimensionless); the average spans
            about ``1 / (1 - decay)`` steps.
        copy_average_at_end: at the end of training copy the average into the model (so ``save_model`` writes it);
            ``False`` leaves the last training iterate there.

    Attributes:
        parameter_names: the averaged parameters' names, set when training begins.
        averaged_model: the :class:`~torch.optim.swa_utils.AveragedModel`, whose ``module`` is an
            ``nn.ParameterList`` in ``parameter_names`` order (``None`` before training).

    Raises:
        TypeError: ``decay`` is not a real number.
        ValueError: ``decay`` is not in (0, 1).
    """

    def __init__(self, decay: float = 0.999, copy_average_at_end: bool = True) -> None:
        if isinstance(decay, bool) or not isinstance(decay, numbers.Real):
            raise TypeError(f"ParameterAveraging: decay must be a number in (0, 1), got {decay!r}")
        if not (math.isfinite(decay) and 0 < decay < 1):
            raise ValueError(
                f"ParameterAveraging: decay must be in (0, 1) (the previous average's weight per step, e.g. 0.999), "
                f"got {decay}"
            )
        self.decay = float(decay)
        self.copy_average_at_end = copy_average_at_end
        self.parameter_names: list[str] = []
        self.averaged_model: AveragedModel | None = None
        #: True while the model's trainable tensors and the averaged model's are exchanged (the model holds the
        #: average, the averaged model the training iterate).
        self._exchanged = False
        self._optimizer_stepped = False
        self._step_hook: RemovableHandle | None = None

    @contextlib.contextmanager
    def averaged_weights(self, model: nn.Module) -> Iterator[nn.Module]:
        """Within the block ``model`` holds the averaged weights; its own come back afterwards, also on an error.

        ``with averaging.averaged_weights(trainer.model): trainer.evaluate()``. Exact, one tensor at a time; ``model``
        is the trained model or one with the same trainable parameter names and shapes.

        Raises:
            RuntimeError: before training began; the model already holds the average (nested block, or between a step
                that evaluates or saves and the next step).
            ValueError: ``model`` lacks some averaged parameter.
        """
        if self.averaged_model is None:
            raise RuntimeError("ParameterAveraging has no average yet: it is formed during training")
        if self._exchanged:
            raise RuntimeError(
                "The model already holds the averaged weights: ParameterAveraging puts them there from a step that "
                "evaluates or saves until the next step begins; evaluate without averaged_weights there"
            )
        self._exchange(model)
        try:
            yield model
        finally:
            self._exchange(model)

    # ----------------------------------------------------------------------------------------------- events
    @override
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        """Start the average at the model's trainable parameters, or, when resuming, restore it from the checkpoint.

        Raises:
            ValueError: a sharded model; no trainable parameter; resuming from a checkpoint without the averaging
                state or with that of other parameters (see :meth:`_restore`).
        """
        model = kwargs["model"]
        if uses_fsdp(model) or args.fsdp or args.deepspeed:
            raise ValueError(
                "ParameterAveraging does not support models sharded across processes (FSDP, DeepSpeed): each process "
                "holds part of the weights"
            )
        if self._exchanged and self.averaged_model is not None:  # an earlier train() stopped while it held the average
            self._exchange(model)
        optimizer = _stepping_optimizer(kwargs["optimizer"])
        if callable(getattr(optimizer, "eval", None)) and callable(getattr(optimizer, "train", None)):
            raise ValueError(
                f"ParameterAveraging does not support {type(optimizer).__name__}: a schedule-free optimizer swaps the "
                "model's weights itself (optimizer.eval() / train()), which would mix its weights with the average"
            )
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("ParameterAveraging: the model has no trainable parameter (requires_grad) to average")
        self.parameter_names = [name for name, _ in trainable]
        self.averaged_model = AveragedModel(
            nn.ParameterList(p for _, p in trainable), multi_avg_fn=get_ema_multi_avg_fn(self.decay)
        ).requires_grad_(False)
        self._exchanged = self._optimizer_stepped = False
        if state.global_step > 0:  # the Trainer restored a checkpoint's state (resume_from_checkpoint)
            self._restore(checkpoint_folder(args, state), model)
        self._remove_step_hook()
        self._step_hook = optimizer.register_step_post_hook(self._record_step)
        if args.eval_on_start:
            self._hold_average(model)
        return control

    @override
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        self._hold_training_weights(kwargs["model"])
        return control

    @override
    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        """Average the new iterate (when the optimizer took the step); hold the average if the step evaluates or
        saves."""
        assert self.averaged_model is not None
        model = kwargs["model"]
        if self._optimizer_stepped:
            self.averaged_model.update_parameters(nn.ParameterList(self._parameters_of(model)))
            self._optimizer_stepped = False
        if control.should_evaluate or control.should_save:
            self._hold_average(model)
        return control

    @override
    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        if control.should_evaluate or control.should_save:
            self._hold_average(kwargs["model"])
        return control

    @override
    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        """Write :data:`AVERAGING_STATE_NAME` into the checkpoint folder the Trainer has just written.

        Raises:
            RuntimeError: the Trainer saved outside ``output_dir/checkpoint-STEP``.
        """
        if self.averaged_model is None or not state.is_world_process_zero:
            return control
        folder = written_checkpoint_folder(args, state, "the averaged weights")
        averaging_state = {
            "parameter_names": self.parameter_names,
            "model_files_fingerprint": _fingerprint(self._parameters_of(kwargs["model"])),
            "averaged_model_state": self.averaged_model.state_dict(),
            "model_files_hold_average": self._exchanged,
        }
        atomic_save(averaging_state, folder / AVERAGING_STATE_NAME)
        return control

    @override
    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> TrainerControl:
        """Give the model its training iterate back, or, with ``load_best_model_at_end``, restore the best
        checkpoint's average and iterate (the Trainer has just loaded its model files); then, with
        ``copy_average_at_end``, copy the average into the model."""
        self._remove_step_hook()
        model = kwargs["model"]
        if args.load_best_model_at_end and state.best_model_checkpoint is not None:
            self._restore(Path(state.best_model_checkpoint), model)
        else:
            self._hold_training_weights(model)
        if self.copy_average_at_end:
            assert self.averaged_model is not None
            with torch.no_grad():
                for parameter, average in zip(
                    self._parameters_of(model), self.averaged_model.module.parameters(), strict=True
                ):
                    parameter.copy_(average)
        return control

    # ---------------------------------------------------------------------------------------------- helpers
    def _record_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._optimizer_stepped = True

    def _remove_step_hook(self) -> None:
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None

    def _parameters_of(self, model: nn.Module) -> list[nn.Parameter]:
        """The model's parameters named :attr:`parameter_names`, in that order.

        Raises:
            ValueError: the model lacks some of them.
        """
        parameters = dict(model.named_parameters())
        missing = [name for name in self.parameter_names if name not in parameters]
        if missing:
            raise ValueError(
                f"The model has no parameter {missing[0]!r} ({len(missing)} missing): ParameterAveraging averaged "
                "another model's parameters"
            )
        return [parameters[name] for name in self.parameter_names]

    def _exchange(self, model: nn.Module) -> None:
        """Exchange the model's trainable tensors with the averaged model's, one tensor at a time (exact)."""
        assert self.averaged_model is not None
        with torch.no_grad():
            for parameter, average in zip(
                self._parameters_of(model), self.averaged_model.module.parameters(), strict=True
            ):
                kept = parameter.detach().clone()
                parameter.copy_(average)
                average.copy_(kept)
        self._exchanged = not self._exchanged

    def _hold_average(self, model: nn.Module) -> None:
        if not self._exchanged:
            self._exchange(model)

    def _hold_training_weights(self, model: nn.Module) -> None:
        if self._exchanged:
            self._exchange(model)

    def _restore(self, folder: Path, model: nn.Module) -> None:
        """Restore the average and the training iterate of the checkpoint in ``folder``, whose model files the
        Trainer has loaded into ``model``; afterwards the model holds the training iterate.

        Raises:
            ValueError: the folder has no (readable) averaging state, or one of other parameters.
        """
        assert self.averaged_model is not None
        path = folder / AVERAGING_STATE_NAME
        if not path.is_file():
            raise ValueError(
                f"{str(folder)!r} has no {AVERAGING_STATE_NAME}: it was not written by a run with ParameterAveraging, "
                "or the run resumed from a checkpoint outside args.output_dir (ParameterAveraging looks for "
                "output_dir/checkpoint-STEP). Resume from such a checkpoint, or without ParameterAveraging"
            )
        saved = load_checkpoint_tensors(path, "the average would restart from the current weights")
        if saved["parameter_names"] != self.parameter_names:
            raise ValueError(
                f"{str(path)!r} averages other parameters than this model's trainable ones "
                f"({len(saved['parameter_names'])} saved, {len(self.parameter_names)} here): resume with the same "
                "model and trainable parameters"
            )
        if saved["model_files_fingerprint"] != _fingerprint(self._parameters_of(model)):
            raise ValueError(
                f"{str(path)!r} belongs to another checkpoint than the one whose weights the Trainer loaded: "
                "ParameterAveraging reads its state from output_dir/checkpoint-STEP, so resume from a checkpoint in "
                "args.output_dir"
            )
        self.averaged_model.load_state_dict(saved["averaged_model_state"])
        self._exchanged = saved["model_files_hold_average"]
        self._hold_training_weights(model)


def _fingerprint(parameters: list[nn.Parameter]) -> list[float]:
    """The float64 sum of each tensor: which weights a checkpoint's model files hold, to check that an averaging
    state belongs to the checkpoint the Trainer resumed from."""
    return [float(p.detach().double().sum()) for p in parameters]


def _stepping_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer that updates the parameters, inside accelerate's ``AcceleratedOptimizer``
    (``.optimizer``) and :class:`~lightning_dp.optim.DPOptimizer` (``.original_optimizer``): its step hooks run
    only for steps actually taken."""
    while (
        inner := getattr(optimizer, "optimizer", None) or getattr(optimizer, "original_optimizer", None)
    ) is not None:
        optimizer = inner
    return optimizer
