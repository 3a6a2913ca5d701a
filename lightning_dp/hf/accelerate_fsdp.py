"""accelerate's FSDP2 configuration for ``DPTrainer``: ``accelerate launch --config_file
configs/accelerate/fsdp2_2_processes.yaml train.py`` (``distributed_type: FSDP``, ``fsdp_version: 2``).

``DPTrainer`` takes the launcher's FSDP settings over (left to the Trainer's ``Accelerator``, FSDP2 would average the
gradients before any clipped sum exists): :func:`fsdp2_settings_from_launcher` reads and checks them,
:func:`shard_as_configured` shards the model by accelerate's wrap policy, :func:`hidden_from_accelerate` hides
``ACCELERATE_USE_FSDP`` while the ``Accelerator`` is built. The model then trains as a user-sharded one
(docs/design.md section 8.1; docs/hf.md, "Sharded models").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from accelerate.utils import FullyShardedDataParallelPlugin
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from lightning_dp.runtime.distributed import distributed_context

#: The variable through which ``accelerate launch`` asks for FSDP.
USE_FSDP_VARIABLE = "ACCELERATE_USE_FSDP"


def fsdp2_settings_from_launcher() -> FullyShardedDataParallelPlugin | None:
    """accelerate's FSDP settings of this process (``None`` when the launcher asked for none).

    Returns:
        the settings as accelerate's ``FullyShardedDataParallelPlugin`` reads them from the environment.

    Raises:
        ValueError: ``fsdp_version: 1`` (FSDP1's flat parameters hide the layers' weights from the clipping hooks), or
            a setting DPTrainer does not honour: ``fsdp_offload_params`` (the gradients would live on the CPU),
            ``fsdp_activation_checkpointing`` (DPTrainer shards the model itself and does not apply accelerate's
            checkpoint wrapper: use ``gradient_checkpointing=True``), ignored modules.
    """
    if os.environ.get(USE_FSDP_VARIABLE, "false").lower() not in ("true", "1", "yes"):
        return None
    plugin = FullyShardedDataParallelPlugin()
    if plugin.fsdp_version != 2:
        raise ValueError(
            f"DPTrainer shards models with FSDP2 only; the accelerate config asks for fsdp_version: "
            f"{plugin.fsdp_version}: set fsdp_version: 2 in its fsdp_config (configs/accelerate/fsdp2_2_processes.yaml)"
        )
    refused = {
        "fsdp_offload_params: true (the gradients would live on the CPU)": isinstance(
            plugin.cpu_offload, CPUOffloadPolicy
        ),
        "fsdp_activation_checkpointing: true (DPTrainer shards the model itself, without accelerate's checkpoint "
        "wrapper: set TrainingArguments(gradient_checkpointing=True) instead)": bool(plugin.activation_checkpointing),
        "fsdp_ignored_modules (their gradients would skip the sharded reduction)": plugin.ignored_modules is not None,
    }
    for setting, given in refused.items():
        if given:
            raise ValueError(
                f"DPTrainer does not support {setting}: remove it from the accelerate config's fsdp_config"
            )
    return plugin


@contextlib.contextmanager
def hidden_from_accelerate() -> Iterator[None]:
    """Within the block, the launcher's FSDP request is absent from the environment (an ``Accelerator`` built there
    does not shard or reduce gradients itself); restored afterwards, for the next ``DPTrainer``."""
    value = os.environ.pop(USE_FSDP_VARIABLE, None)
    try:
        yield
    finally:
        if value is not None:
            os.environ[USE_FSDP_VARIABLE] = value


def shard_as_configured(model: nn.Module, plugin: FullyShardedDataParallelPlugin, device: torch.device) -> None:
    """Shard ``model`` in place with ``fully_shard`` by the plugin's wrap policy, and give every rank its shard of rank
    0's weights.

    Blocks selected by accelerate's ``fsdp2_prepare_auto_wrap_policy`` innermost first, then the root, with the plugin's
    ``reshard_after_forward``, on a one-dimensional mesh of all ranks; rank 0's state dict is broadcast into the shards
    and its buffers broadcast. Each rank holds the whole model in CPU memory until it is sharded. No mixed-precision
    policy is set and ``parallelism_config`` (HSDP, tensor or context parallelism) is not read. Details:
    docs/design.md section 12.1.

    Args:
        model: the unsharded model (on CPU, ``device`` or ``meta``), the same architecture on every rank.
        plugin: the settings of :func:`fsdp2_settings_from_launcher`.
        device: this rank's training device (``TrainingArguments.device``).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised; the ranks' models differ in their parameters' or
            buffers' names, shapes or dtypes.
        ValueError: a layer class named by ``fsdp_transformer_layer_cls_to_wrap`` is not in the model.
    """
    context = distributed_context()
    if context is None:
        raise RuntimeError(
            "accelerate's FSDP settings need several processes: start the script with accelerate launch --config_file"
        )
    _materialise_meta(model, torch.device("cpu"))
    layout = [(name, tuple(t.shape), t.dtype) for name, t in [*model.named_parameters(), *model.named_buffers()]]
    context.check_identical("model's parameters and buffers (names, shapes, dtypes)", layout)
    full = model.state_dict() if context.is_main else {}
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    options = {"mesh": mesh, "reshard_after_forward": plugin.reshard_after_forward}
    if policy is not None:
        for module in reversed(list(model.modules())[1:]):
            if policy(module):
                fully_shard(module, **options)
    fully_shard(model, **options)
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    context.broadcast_module(model)  # the buffers (non-persistent ones too); the parameters are all shards now


def _materialise_meta(model: nn.Module, device: torch.device) -> None:
    """Replace every parameter and buffer on the ``meta`` device by an uninitialised one on ``device`` (tied
    parameters stay tied: one replacement per tensor; a transformers model's ties that moving it to ``meta`` broke are
    restored first with its ``tie_weights``, as accelerate does)."""
    if not any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        return
    if callable(getattr(model, "tie_weights", None)):
        model.tie_weights()
    replacements: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None or not tensor.is_meta:
                    continue
                if id(tensor) not in replacements:
                    empty = torch.empty_like(tensor, device=device)
                    is_parameter = isinstance(tensor, nn.Parameter)
                    replacements[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if is_parameter else empty
                table[name] = replacements[id(tensor)]
