"""Parameters sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``): what the clipper and the optimizer need of
them (docs/design.md section 8.1).

Under FSDP2 every parameter registered in a sharded module is a ``DTensor`` holding one shard of the full tensor per
rank (``Shard(0)`` along the data-parallel mesh dimension, replicated along a replicate dimension under HSDP). During
a sharded module's forward and backward FSDP2 swaps in the unsharded parameter (a plain full-size tensor, the leaf
autograd sees), so layer hooks see the whole weight and the per-sample terms and norms are those of one process.
What differs from replicated (DDP) training:

- the clipped sum each rank forms from its examples by book-keeping is full-size; :func:`sum_into_shard` sums it over
  the ranks and keeps this rank's shard (one reduce-scatter), so the gradient reaches the optimizer sharded, as
  FSDP2's own;
- noise is drawn per shard: each coordinate is owned by exactly one shard, whose owner draws its noise once from the
  shard's own stream (:func:`shard_key`; ranks holding replicas of one shard draw the same values);
- state kept per parameter (per-sample momentum's iterates, the low-pass filter's history) is kept as shards, and
  goes into checkpoints :func:`gathered` to full values, from which each rank takes its shard back
  (:func:`shard_like`).
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
    """Put every FSDP2-managed parameter of ``module`` back into its registered sharded form (after a forward FSDP2
    may keep some gathered, e.g. the root's, until the next backward)."""
    for submodule in module.modules():
        if isinstance(submodule, FSDPModule):
            submodule.reshard()


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: a sharded tensor's local shard (sharing its storage, so in-place
    changes reach the ``DTensor``), any other tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def gathered(tensor: torch.Tensor) -> torch.Tensor:
    """The full value of a sharded tensor (a collective: every rank of its mesh must call it), any other tensor
    itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def gathered_on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """The full value of ``tensor`` in CPU memory, for a checkpoint's state: a sharded tensor is gathered (a
    collective) and moved at once, so that gathering many tensors one after another holds at most one full tensor on
    the device beyond its shards."""
    return gathered(tensor).detach().cpu()


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` (every rank holding the same full value, e.g. read from one checkpoint file) laid out as ``like``:
    this rank's shard of it for a sharded ``like`` (no communication), else ``full`` itself; on ``like``'s device
    and dtype either way."""
    full = full.to(device=like.device, dtype=like.dtype)
    if not isinstance(like, DTensor) or isinstance(full, DTensor):
        return full
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def sum_into_shard(full: torch.Tensor, param: DTensor) -> DTensor:
    """The sum over all ranks of their full-size ``full`` tensors, laid out as ``param`` (this rank keeps its shard).

    Args:
        full: this rank's full-size tensor, ``param``'s global shape (e.g. its clipped sum over its own examples).
        param: the sharded parameter whose layout (mesh and placements) the result takes.

    Returns:
        A ``DTensor`` with ``param``'s placements: one reduce-scatter along sharded dimensions (all-reduce along
        replicated ones). A collective: every rank of the mesh must call it for the same parameter, in the same
        order.
    """
    mesh = param.device_mesh
    pending = DTensor.from_local(full, mesh, [Partial()] * mesh.ndim, run_check=False)
    return pending.redistribute(mesh, param.placements)


def shard_key(tensor: DTensor) -> tuple[int, ...]:
    """Which shard of ``tensor`` this rank holds, as integers naming a noise stream: the mesh's shape, then
    ``(mesh dimension, coordinate)`` for each sharded dimension (ranks holding replicas of a shard get the same key;
    tensors sharded along different mesh dimensions, or on meshes of other shapes, get different ones). Two meshes of
    one shape over the ranks in different orders would give one key to different shards: the model's sharded
    parameters must live on one mesh (as with ``fully_shard`` on one ``init_device_mesh``)."""
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise RuntimeError("this rank is not part of the sharded tensor's device mesh")
    sharded = [(dim, c) for dim, (c, placement) in enumerate(zip(coordinate, tensor.placements, strict=True))]
    sharded = [pair for pair, placement in zip(sharded, tensor.placements, strict=True) if placement.is_shard()]
    return (mesh.ndim, *mesh.shape, *(value for pair in sharded for value in pair))


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) parameters and buffers of a sharded ``module`` on rank 0's CPU, ``{}`` on other ranks.

    A collective: every rank must call it (each sends its shards). Plain tensors come back as they are.
    """
    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast("dict[str, torch.Tensor]", state)  # a model's state: parameters and buffers, all tensors


def save_sharded(folder: str | os.PathLike[str], module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write ``module``'s and ``optimizer``'s state to ``folder`` with ``torch.distributed.checkpoint`` (each rank
    writes its shards; a collective). The folder is not written atomically.

    Args:
        folder: the checkpoint folder to create.
        module: the (sharded) model.
        optimizer: the user's optimizer, never a ``DPOptimizer``: torch creates a missing optimizer state by calling
            ``step()``, which on the wrapper would add noise and record a privacy step.
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
    """Load the optimizer state :func:`save_sharded` wrote into ``optimizer`` (the user's optimizer, as there; a
    collective).

    Raises:
        ValueError: the folder does not hold this optimizer's state (another model or optimizer).
    """
    state = {"optimizer": get_optimizer_state_dict(module, optimizer)}
    _load(state, folder)
    set_optimizer_state_dict(module, optimizer, state["optimizer"])


def _load(state: dict[str, Any], folder: str | os.PathLike[str]) -> None:
    """``dcp.load`` into ``state`` in place; a mismatch raises a ``ValueError`` that names the missing tensors
    (``dcp``'s own ``CheckpointException`` derives from ``BaseException`` and names only the ranks)."""
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
