"""Parameters sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``): what the clipper and the optimizer need of
them (docs/design.md section 8.1): the clipped sum reduce-scattered into shards (:func:`sum_into_shard`), noise per
shard (:func:`shard_key`), and per-parameter state gathered for checkpoints (:func:`gathered`, :func:`shard_like`,
:func:`gathered_part`, :func:`part_like`).
"""

from __future__ import annotations

import os
from typing import Any, TypeGuard, cast

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Partial, distribute_tensor


def is_sharded(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a ``DTensor`` (a sharded parameter or gradient)."""
    return isinstance(tensor, DTensor)


def uses_fsdp(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` or to one of its submodules."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


def reshard_all(module: nn.Module) -> None:
    """Put every FSDP2-managed parameter of ``module`` back into its registered sharded form."""
    for submodule in module.modules():
        if isinstance(submodule, FSDPModule):
            submodule.reshard()


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor``: a ``DTensor``'s local shard (shared storage), any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """The full value of a sharded tensor (a collective over its mesh), any other tensor itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def gathered_on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """The full value of ``tensor`` in CPU memory (a collective for a sharded tensor; at most one full tensor on the
    device at a time).
    """
    return gathered(tensor).detach().cpu()


def shard_like(full: torch.Tensor, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``full`` (the same full value on every rank) laid out as ``like``: this rank's shard for a sharded ``like`` (no
    communication), else ``full``; on ``like``'s device, in ``dtype`` (default: ``like``'s).
    """
    full = full.to(device=like.device, dtype=like.dtype if dtype is None else dtype)
    if not isinstance(like, DTensor) or isinstance(full, DTensor):
        return full
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def gathered_part(part: torch.Tensor, like: torch.Tensor, *, keep: bool = True) -> torch.Tensor | None:
    """The full value of ``part``, this rank's part of a tensor laid out as ``like``, in CPU memory: for a sharded
    ``like`` its local shard, gathered (a collective over its mesh); for any other ``like``, ``part`` itself.

    Args:
        part: shaped like ``like``'s local shard (``like.to_local()``), any dtype.
        like: the parameter ``part`` belongs to.
        keep: ``False`` on a rank that only takes part in the gather: ``None`` is returned, no full copy is kept.
    """
    if not isinstance(like, DTensor):
        return part.detach().cpu() if keep else None
    spread = DTensor.from_local(
        part.detach(), like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )
    full = spread.full_tensor()  # a collective: every rank of the mesh takes part
    return full.cpu() if keep else None


def part_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full`` laid out as ``like`` (the inverse of :func:`gathered_part`; no communication), on
    ``like``'s device, in ``full``'s dtype.

    Raises:
        ValueError: ``full`` is not shaped like ``like`` (its global shape).
    """
    if full.shape != like.shape:
        raise ValueError(f"a tensor of shape {tuple(full.shape)} cannot take the place of one of {tuple(like.shape)}")
    return local_part(shard_like(full, like, dtype=full.dtype))


def sum_into_shard(full: torch.Tensor, param: DTensor) -> DTensor:
    """The sum over all ranks of their full-size ``full`` tensors, laid out as ``param`` (this rank keeps its shard).

    Args:
        full: this rank's full-size tensor, ``param``'s global shape.
        param: the sharded parameter whose mesh and placements the result takes.

    Returns:
        A ``DTensor`` with ``param``'s placements (reduce-scatter on sharded dimensions, all-reduce on replicated).
        A collective: every rank calls it for the same parameters in the same order.
    """
    mesh = param.device_mesh
    pending = DTensor.from_local(full, mesh, [Partial()] * mesh.ndim, run_check=False)
    return pending.redistribute(mesh, param.placements)


def shard_key(tensor: DTensor) -> tuple[int, ...]:
    """Which shard of ``tensor`` this rank holds, as integers naming a noise stream: the mesh shape, then ``(mesh
    dimension, coordinate)`` per sharded dimension (replicas share a key). The model's sharded parameters must live on
    one mesh.
    """
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise RuntimeError("this rank is not part of the sharded tensor's device mesh")
    sharded = [(dim, c) for dim, (c, placement) in enumerate(zip(coordinate, tensor.placements, strict=True))]
    sharded = [pair for pair, placement in zip(sharded, tensor.placements, strict=True) if placement.is_shard()]
    return (mesh.ndim, *mesh.shape, *(value for pair in sharded for value in pair))


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The full parameters and buffers of a sharded ``module`` on rank 0's CPU, ``{}`` on other ranks (a collective)."""
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast("dict[str, torch.Tensor]", state)  # a model's state: parameters and buffers, all tensors


def save_sharded(folder: str | os.PathLike[str], module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write ``module``'s and ``optimizer``'s state to ``folder`` with ``torch.distributed.checkpoint`` (a collective;
    not atomic).

    Args:
        folder: the checkpoint folder to create.
        module: the (sharded) model.
        optimizer: the user's optimizer, never a ``DPOptimizer`` (a ``step()`` on it would add noise and record a step).
    """
    state = {"model": get_model_state_dict(module), "optimizer": get_optimizer_state_dict(module, optimizer)}
    dcp.save(state, checkpoint_id=folder)


def load_sharded_model(folder: str | os.PathLike[str], module: nn.Module) -> None:
    """Load the model state :func:`save_sharded` wrote into ``module`` (a collective).

    Raises:
        ValueError: the folder does not hold ``module``'s state (another model, other adapters).
    """
    state = {"model": get_model_state_dict(module)}
    _load(state, folder)
    set_model_state_dict(module, state["model"])


def load_sharded_optimizer(folder: str | os.PathLike[str], module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load the optimizer state :func:`save_sharded` wrote into the user's ``optimizer`` (a collective).

    Raises:
        ValueError: the folder does not hold this optimizer's state (another model or optimizer).
    """
    state = {"optimizer": get_optimizer_state_dict(module, optimizer)}
    _load(state, folder)
    set_optimizer_state_dict(module, optimizer, state["optimizer"])


def _load(state: dict[str, Any], folder: str | os.PathLike[str]) -> None:
    """``dcp.load`` into ``state`` in place; a mismatch raises ``ValueError`` naming the missing tensors."""
    stored = set(dcp.FileSystemReader(folder).read_metadata().state_dict_metadata)
    missing = sorted(set(_tensor_keys(state)) - stored)
    try:
        if not missing:
            dcp.load(state, checkpoint_id=folder)
    except CheckpointException as error:
        missing = [str(error)]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(
            f"the sharded checkpoint {str(folder)!r} does not match: {shown}; resume with the model, adapters and "
            "optimizer of the run that wrote it"
        )


def _tensor_keys(state: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys ``dcp`` stores the tensors of a nested state dict under."""
    keys = []
    for name, value in state.items():
        if isinstance(value, dict):
            keys += _tensor_keys(value, f"{prefix}{name}.")
        elif isinstance(value, torch.Tensor):
            keys.append(f"{prefix}{name}")
    return keys
