"""What :class:`~lightning_dp.hf.DPTrainer` refuses at construction (and, on a sharded model, at ``train``), each
refusal saying what to change, and what it switches off or ignores with a warning.

Plain functions taking what they read; :mod:`lightning_dp.hf.trainer` calls them in ``DPTrainer.__init__`` (and
:func:`check_training_arguments` again, with :func:`check_sharded_run`, in ``DPTrainer.train``: the arguments can be
changed in between). What is not supported, and why, is summed up in the module
docstring of :mod:`lightning_dp.hf.trainer` and in docs/hf.md.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch import nn
from transformers import TrainingArguments

from lightning_dp.clipping.recomputation import REENTRANT_MESSAGE
from lightning_dp.config import PrivacyConfig
from lightning_dp.engine.adapter import framework_clipping
from lightning_dp.hf.arguments import PrivacyArguments
from lightning_dp.hf.losses import head_kind

log = logging.getLogger("lightning_dp")

#: ``TrainingArguments.max_grad_norm``'s default; DPTrainer switches it off (with a log line) rather than reject it.
_HF_DEFAULT_MAX_GRAD_NORM = 1.0

#: What the messages refusing other sharding set-ups say to do instead.
_SHARDED_ROUTE = (
    "to shard a model, launch with an FSDP2 accelerate config (fsdp_version: 2, as configs/accelerate/"
    "fsdp2_2_processes.yaml) or apply torch's fully_shard to its blocks and root before DPTrainer (docs/hf.md, "
    "'Sharded models')"
)

_UNSUPPORTED = {
    "reentrant activation checkpointing (gradient_checkpointing with use_reentrant=True)": REENTRANT_MESSAGE,
    "a DeepSpeed config": f"DPTrainer does its own gradient reduction; {_SHARDED_ROUTE}",
    "FSDP": f"DPTrainer does its own gradient reduction; {_SHARDED_ROUTE}",
    "torch_compile=True": "compiled graphs bypass the clipping hooks; switch it off",
    "auto_find_batch_size=True": "a batch size changed mid-run changes the sample rate the accountant assumes; set "
    "per_device_train_batch_size",
    "several GPUs in one process (DataParallel)": "use one process per GPU",
    "include_num_input_tokens_seen": "it logs and saves the sampled examples' token count without noise (a count of "
    "the private data); leave it 'no'",
    "neftune_noise_alpha": "NEFTune scales each example's embedding noise by the batch's padded length, so an "
    "example's gradient depends on which other examples were drawn; leave it None",
}


def warn_ignored_without_dp(config: PrivacyConfig) -> None:
    """With ``disable_dp=True`` (the plain Trainer's training), warn about the options that are then ignored."""
    if config.augmentation_multiplicity > 1:
        log.warning(
            "disable_dp=True: augmentation_multiplicity=%d is ignored (Trainer's own training step, one row "
            "per example, no copies and no augment_copies call)",
            config.augmentation_multiplicity,
        )
    if config.privacy_unit == "user":
        log.warning("disable_dp=True: privacy_unit='user' is ignored (the Trainer's own batches of examples)")


#: ``hub_strategy`` values that push whole checkpoint folders (``HubStrategy`` is a ``str`` enum).
_PUSHED_CHECKPOINTS = ("checkpoint", "all_checkpoints")


def check_training_arguments(args: TrainingArguments, privacy_args: PrivacyArguments) -> None:
    """Reject training arguments DP training does not support, saying what to change; switch off the Trainer's
    default batch clipping (``max_grad_norm=1.0``) with a log line.

    Raises:
        ValueError: see :data:`_UNSUPPORTED`; ``max_grad_norm`` other than 0 or the Trainer's default; ``exact_resume``
            with a push of checkpoint folders to the Hub (they would publish its secret state).
    """
    checkpointing = args.gradient_checkpointing or args.activation_checkpointing
    kwargs = dict(args.gradient_checkpointing_kwargs or {})
    kwargs.update(args.activation_checkpointing_kwargs or {})
    active = {
        "reentrant activation checkpointing (gradient_checkpointing with use_reentrant=True)": bool(checkpointing)
        and kwargs.get("use_reentrant", False) is True,
        "a DeepSpeed config": bool(args.deepspeed),
        "FSDP": bool(args.fsdp),
        "torch_compile=True": args.torch_compile,
        "auto_find_batch_size=True": args.auto_find_batch_size,
        "several GPUs in one process (DataParallel)": args.n_gpu > 1,
        "include_num_input_tokens_seen": args.include_num_input_tokens_seen != "no",  # the Trainer counts unless "no"
        "neftune_noise_alpha": args.neftune_noise_alpha is not None,
    }
    for name, is_set in active.items():
        if is_set:
            raise ValueError(f"DPTrainer does not support {name}: {_UNSUPPORTED[name]}")
    hub_strategy = getattr(args.hub_strategy, "value", args.hub_strategy)
    if privacy_args.exact_resume and args.push_to_hub and hub_strategy in _PUSHED_CHECKPOINTS:
        raise ValueError(
            f"exact_resume=True with push_to_hub and hub_strategy={hub_strategy!r} would upload the "
            "checkpoints' secret state (it reveals the noise): use hub_strategy='every_save' or 'end', or remove "
            "exact_resume"
        )
    clipping = framework_clipping(args.max_grad_norm, framework_default=_HF_DEFAULT_MAX_GRAD_NORM)
    if clipping == "refuse":
        raise ValueError(
            f"TrainingArguments.max_grad_norm={args.max_grad_norm} would clip the noisy gradient again: set it to 0 "
            "and give the per-sample clipping bound as PrivacyArguments(per_sample_max_grad_norm=...)"
        )
    if clipping == "switch off":
        log.warning(
            "TrainingArguments.max_grad_norm=%s (the Trainer's default batch clipping) is switched off (set to 0): "
            "DPTrainer clips each example's gradient at PrivacyArguments.per_sample_max_grad_norm=%s instead",
            args.max_grad_norm,
            privacy_args.per_sample_max_grad_norm,
        )
        args.max_grad_norm = 0.0


def check_trainer_neftune(alpha: float | None) -> None:
    """Refuse NEFTune as ``train()`` will run it: ``Trainer.__init__`` copies ``args.neftune_noise_alpha`` into the
    trainer's ``neftune_noise_alpha``, the value ``Trainer.train`` reads.

    Raises:
        ValueError: ``alpha`` is not ``None``.
    """
    if alpha is not None:
        raise ValueError(f"DPTrainer does not support neftune_noise_alpha: {_UNSUPPORTED['neftune_noise_alpha']}")


def check_accelerator_and_model(model: nn.Module, *, deepspeed_enabled: bool, fsdp_enabled: bool) -> None:
    """Reject what accelerate or transformers set up outside DPTrainer: DeepSpeed, an FSDP plugin (DPTrainer hid the
    launcher's FSDP settings, so one left is a plugin set up before it, elsewhere), a model sharded by
    ``from_pretrained`` (:func:`sharded_by_from_pretrained`).

    Args:
        model: the Trainer's model.
        deepspeed_enabled: ``Trainer.is_deepspeed_enabled`` (set by accelerate's config or environment).
        fsdp_enabled: ``Trainer.is_fsdp_enabled``.

    Raises:
        ValueError: any of them, saying what to do instead.
    """
    if deepspeed_enabled:
        reason = _UNSUPPORTED["a DeepSpeed config"]
        raise ValueError(f"DPTrainer does not support DeepSpeed from accelerate: {reason}")
    if fsdp_enabled:
        raise ValueError(
            "DPTrainer does not support an FSDP plugin accelerate set up before it (an Accelerator built earlier "
            f"in this process, or one passed by hand): {_UNSUPPORTED['FSDP']}"
        )
    if sharded_by_from_pretrained(model):
        raise ValueError(
            "DPTrainer does not train a model sharded by from_pretrained(distributed_config=... or tp_plan=...): "
            "the Trainer would average replicated gradients before the noise; load it unsharded and apply "
            "fully_shard to its blocks and root before DPTrainer (docs/hf.md, 'Sharded models')"
        )


def sharded_by_from_pretrained(model: nn.Module) -> bool:
    """Whether transformers' ``from_pretrained`` sharded ``model`` over the processes as it loaded it
    (``distributed_config=...``, or tensor parallelism by ``tp_plan``): the releases that name it set
    ``is_distributed_loading_by_transformers``, and every release that shards at load time sets the model's
    ``_device_mesh`` (``None`` otherwise). A PEFT model passes both on from the model it wraps."""
    return bool(getattr(model, "is_distributed_loading_by_transformers", False)) or (
        getattr(model, "_device_mesh", None) is not None
    )


def check_model_and_loss(
    model: nn.Module, model_init: Any, compute_loss_func: Any, label_names: Sequence[str], custom_loss: bool
) -> str | None:
    """Reject a model or loss set-up that cannot give one loss per example, saying what to change.

    Args:
        model: the Trainer's model.
        model_init: ``Trainer.model_init``.
        compute_loss_func: ``Trainer.compute_loss_func``.
        label_names: ``Trainer.label_names``.
        custom_loss: whether a subclass overrides ``DPTrainer.compute_per_example_loss``.

    Returns:
        The model's head (:func:`~lightning_dp.hf.losses.head_kind`) for the built-in per-example losses; ``None``
        with a ``compute_per_example_loss`` of a subclass.

    Raises:
        ValueError: ``model_init``, ``compute_loss_func``, a head without a built-in per-example loss, label names
            other than ``['labels']`` (the last two only without a ``compute_per_example_loss`` of a subclass).
    """
    if model_init is not None:
        raise ValueError(
            "DPTrainer does not support model_init: the model must exist before training to attach per-sample "
            "clipping; pass model="
        )
    if compute_loss_func is not None:
        raise ValueError(
            "DPTrainer does not support compute_loss_func (it returns one loss per batch): override "
            "DPTrainer.compute_per_example_loss to return one loss per example"
        )
    if custom_loss:
        return None
    head = head_kind(model)
    if list(label_names) != ["labels"]:
        raise ValueError(
            f"DPTrainer forms per-example losses from a 'labels' column, this model uses {label_names}: "
            "override DPTrainer.compute_per_example_loss for it"
        )
    return head


def check_sharded_run(args: TrainingArguments) -> None:
    """Refuse, on an FSDP2-sharded model, what DPTrainer does not do there.

    Raises:
        ValueError: ``save_on_each_node`` (only rank 0 receives the gathered weights, so other nodes would write
            folders without them).
    """
    if args.save_on_each_node and args.save_strategy != "no":
        raise ValueError(
            "save_on_each_node=True on an FSDP2-sharded model: only rank 0 receives the gathered weights and the "
            "shards' index, so other nodes' checkpoints would be incomplete; set save_on_each_node=False and "
            "write checkpoints to a filesystem every node reads"
        )


def check_resume_skips_no_batches(args: TrainingArguments, config: PrivacyConfig) -> None:
    """Refuse to resume correlated noise (``noise_correlation``) or an ``exact_resume`` run while the Trainer skips the
    resumed epoch's first batches.

    The Trainer draws and drops those batches (``skip_first_batches``), which would shift the cyclic groups, and the
    steps an exact resume keys its batches by, against the steps (:mod:`lightning_dp.data.cyclic_poisson`); under
    Poisson sampling the skipped batches are fresh draws anyway, so ``ignore_data_skip=True`` loses nothing and the run
    takes the same steps.

    Raises:
        ValueError: correlated noise or ``exact_resume`` with ``ignore_data_skip=False``.
    """
    if args.ignore_data_skip:
        return
    if config.noise_correlation is not None:
        raise ValueError(
            f"noise_correlation={config.noise_correlation!r} resumes only with TrainingArguments(ignore_data_skip="
            "True): skipping the epoch's first batches would shift the cyclic groups against the steps"
        )
    if config.exact_resume:
        raise ValueError(
            "exact_resume=True resumes only with TrainingArguments(ignore_data_skip=True): skipping the epoch's first "
            "batches would shift the batches against the steps they are keyed by"
        )
