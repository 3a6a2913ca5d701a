"""``exact_resume`` under Lightning: the global random state the model's own randomness draws from (dropout, and what
a step or the data loading draws from torch, numpy or Python's ``random``), which Lightning's checkpoints do not keep
(the HF Trainer's do), saved per rank in the checkpoint's secret state and restored when the checkpoint is loaded
(docs/privacy.md, "Checkpoints and resume")."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from lightning_dp.runtime.distributed import DistributedContext

#: the key of the ranks' global random states in the secret state (``checkpoint["lightning_dp"]["exact_resume"]``).
KEY = "global_randomness"


class GlobalRandomness:
    """Saves and restores the ranks' global random states: torch's CPU generator, the accelerator's of the rank's
    device (CUDA, XPU, MPS), numpy's legacy global one and Python's. Each is kept as tensors, strings and numbers, so a
    checkpoint holding them still loads with ``torch.load(weights_only=True)``. A restored state is saved again, as it
    was, until training starts (:meth:`started`): a checkpoint written before that, or after a refused resume, is the
    loaded checkpoint's."""

    def __init__(self) -> None:
        self._restored: list[dict[str, Any]] | None = None

    def save(self, secret: dict[str, Any], device: torch.device, distributed: DistributedContext | None) -> None:
        """Add every rank's state, in rank order, to the checkpoint's ``secret`` state (a collective on several
        processes unless a restored state is kept: every rank calls it)."""
        if self._restored is not None:
            secret[KEY] = self._restored
            return
        state = _current_state(device)
        secret[KEY] = [state] if distributed is None else distributed.gather_objects(state)

    def restore(self, secret: dict[str, Any], device: torch.device, rank: int, world_size: int) -> None:
        """Set this rank's state to the one :meth:`save` wrote (nothing when the checkpoint holds none, or the states
        of another number of processes, which the draw schedule refuses when training starts:
        :func:`~lightning_dp.engine.exact_resume.check_draw_schedule`); an earlier load's state is forgotten.

        Raises:
            ValueError: as :meth:`check` (nothing changes then).
        """
        self.check(secret)
        self._restored = None
        states = secret.get(KEY)
        if states is None:
            return
        self._restored = states
        if len(states) == world_size:
            _set_state(states[rank], device)

    @staticmethod
    def check(secret: dict[str, Any]) -> None:
        """Whether :meth:`restore` accepts ``secret``, without changing anything.

        Raises:
            ValueError: a malformed entry: not a list of states, or a state its generator does not take (each is set
                on a generator of its own kind, not the global one).
        """
        states = secret.get(KEY)
        if states is not None and (not isinstance(states, list) or not all(_settable(s) for s in states)):
            raise ValueError(f"The checkpoint's {KEY} entry is corrupted; resume from an intact checkpoint")

    def started(self) -> None:
        """Training started on the restored state: later checkpoints save the current one."""
        self._restored = None


_KEYS = {"torch", "numpy", "python", "accelerator"}


def _settable(state: Any) -> bool:
    """Whether :func:`_set_state` can set ``state``: tried on fresh generators of each kind, the accelerator's where
    this machine has one of its type (a state of another device type is never set: :func:`_set_state`)."""
    if not isinstance(state, dict) or not _KEYS <= state.keys():
        return False
    accelerator = state["accelerator"]
    if accelerator is not None and not (
        isinstance(accelerator, tuple | list)
        and len(accelerator) == 2
        and isinstance(accelerator[0], str)
        and isinstance(accelerator[1], torch.Tensor)
        and accelerator[1].dtype == torch.uint8
        and accelerator[1].device.type == "cpu"
    ):
        return False
    try:
        if (
            accelerator is not None
            and accelerator[0] in _INDEXED
            and torch.get_device_module(accelerator[0]).is_available()
        ):
            torch.Generator(device=accelerator[0]).set_state(accelerator[1])
        torch.Generator().set_state(state["torch"])
        np.random.RandomState().set_state(_numpy_state(state["numpy"]))
        random.Random().setstate(_python_state(state["python"]))
    except (AttributeError, IndexError, KeyError, OverflowError, RuntimeError, TypeError, ValueError):
        return False
    return True


def _current_state(device: torch.device) -> dict[str, Any]:
    kind, keys, position, has_gauss, cached_gaussian = np.random.get_state()  # noqa: NPY002 - the legacy global one
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy": (str(kind), torch.from_numpy(keys.astype(np.int64)), int(position), int(has_gauss), cached_gaussian),
        "python": (version, tuple(internal), gauss),
        "accelerator": _accelerator_state(device),
    }


def _set_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(_numpy_state(state["numpy"]))  # noqa: NPY002 - the legacy global one
    random.setstate(_python_state(state["python"]))
    if state["accelerator"] is None or state["accelerator"][0] != device.type:  # another device: drawn fresh
        return
    module, accelerator = torch.get_device_module(device.type), state["accelerator"][1]
    if device.type in _INDEXED:
        module.set_rng_state(accelerator, device)
    else:
        module.set_rng_state(accelerator)


def _numpy_state(saved: Any) -> tuple[Any, ...]:
    """The argument of numpy's ``set_state`` for the ``"numpy"`` entry :func:`_current_state` wrote."""
    kind, keys, position, has_gauss, cached_gaussian = saved
    return kind, keys.numpy().astype(np.uint32), position, has_gauss, cached_gaussian


def _python_state(saved: Any) -> tuple[Any, ...]:
    """The argument of ``random.setstate`` for the ``"python"`` entry :func:`_current_state` wrote."""
    version, internal, gauss = saved
    return version, tuple(internal), gauss


def _accelerator_state(device: torch.device) -> tuple[str, torch.Tensor] | None:
    """``(device type, state)`` of ``device``'s generator (``None`` on the CPU, whose generator is ``"torch"``'s)."""
    if device.type == "cpu":
        return None
    module = torch.get_device_module(device.type)
    return device.type, module.get_rng_state(device) if device.type in _INDEXED else module.get_rng_state()


#: the accelerators whose generator functions take the device (MPS has one device).
_INDEXED = ("cuda", "xpu")
