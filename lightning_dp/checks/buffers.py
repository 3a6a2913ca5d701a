"""Buffers and frozen parameters written during a training forward (docs/design.md section 9.2); one of the
run-time checks of :mod:`lightning_dp.checks`.

Per-sample clipping bounds each example's influence on the GRADIENT. State written during the forward without
noise escapes it: a module that updates a buffer or a frozen parameter
(``requires_grad=False``) from the data (a hand-written running mean) stores data in the ``state_dict`` that is
released with the model. :class:`BufferWatch` fails, naming the module and the tensor, when one was written or
replaced during a training forward. On EVERY step it compares each tensor's identity, version counter and storage
address (``data_ptr()``): in-place ops on the tensor or a ``.detach()`` of it (``buf.add_(...)``,
``buf.detach().copy_(...)``), reassignment of the attribute (``self.buf = ...``) and ``buf.data = ...`` are caught;
no tensor work. A write through ``.data`` (``buf.data.copy_(...)``: that alias has its own version counter) changes
none of the three, so on the FIRST training forward, and on every step while the batch-independence check is
pending, it also compares the contents before and after the forward (exact equality for tensors up to
:data:`EXACT_COMPARE_NUMEL` elements, the float64 sum and sum of squares for larger ones: one read of every watched
tensor, no copy of the large ones; a write that keeps both, e.g. a permutation, is missed). Such a write on a later
step only is not caught.

The weights a peft LoRA ``ParamWrapper`` adapts (``LoraConfig(target_parameters=...)``, e.g. fused MoE experts) are
the exception: peft's forward registers a parametrization around the wrapped call, which ``set_``s the weight to
itself (same storage, version counter one up), so their version counter says nothing. Their identity and storage
address are compared as for the others, and their contents on EVERY step (exactly or by checksum, as above).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_dp.clipping.layers.fallback import is_parameter_wrapper, wrapped_base
from lightning_dp.clipping.layers.registry import UnsupportedModuleError
from lightning_dp.runtime.sharding import is_sharded, local_part, reshard_all, uses_fsdp

#: watched tensors up to this many elements are cloned and compared exactly on the content check; larger ones by
#: checksum (float64 sum and sum of squares), so a large frozen base (LoRA) is read in chunks, never copied whole.
EXACT_COMPARE_NUMEL = 2**16
_CHECKSUM_CHUNK = 2**22


class BufferWatch:
    """Detects buffers and frozen parameters written or replaced during a training forward (see the module
    docstring for what is caught on every step and what only when contents are compared).

    Args:
        module: the model (all its buffers, persistent or not, are watched: a non-persistent buffer written from the
            data still shapes later outputs; and every parameter with ``requires_grad=False``).
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._before: dict[str, tuple[int, int, int]] = {}
        self._contents: dict[str, torch.Tensor] = {}
        self._sharded: dict[str, torch.Tensor] = {}
        self._uses_fsdp = uses_fsdp(module)

    def _registered(self) -> dict[str, torch.Tensor]:
        """The buffers and frozen parameters the module holds now, by name."""
        registered = dict(self.module.named_buffers())
        registered.update((name, p) for name, p in self.module.named_parameters() if not p.requires_grad)
        return registered

    def _watched(self) -> dict[str, torch.Tensor]:
        """The watched tensors by name. A frozen parameter sharded by FSDP2 is the ``DTensor`` registered at
        :meth:`start`: during a forward FSDP2 registers the gathered copy in its place, which it frees when it
        reshards. A write to that copy never reaches the shard, the state_dict or the next step; within the step
        it can mix examples, which the batch-independence check looks for."""
        return {**self._registered(), **self._sharded}

    def _wrapped(self) -> set[int]:
        """The ids of the parameters a peft ``ParamWrapper`` adapts (their version counter moves every forward)."""
        return {
            id(getattr(wrapped_base(wrapper)[1], str(wrapper.parameter_name)))
            for wrapper in self.module.modules()
            if is_parameter_wrapper(wrapper)
        }

    def _state(self) -> dict[str, tuple[int, int, int]]:
        wrapped = self._wrapped()
        return {
            name: (id(t), -1 if id(t) in wrapped else t._version, local_part(t).data_ptr())
            for name, t in self._watched().items()
        }

    def start(self, *, contents: bool = False) -> None:
        """Record identities, version counters and storage addresses (call right before the training forward);
        with ``contents``, also a copy (small tensors) or checksum (large ones) of each tensor's contents (of
        this rank's shard for a sharded one); of the weights a peft ``ParamWrapper`` adapts, always.

        A sharded module is resharded first (no communication), so that every sharded frozen parameter is recorded
        as its ``DTensor``: after a forward that no backward followed (an evaluation), FSDP2 keeps the root's
        gathered copies registered, and anything that reshards within the step (the re-runs at per-sample
        momentum's iterates) would register the ``DTensor`` back in their place."""
        if self._uses_fsdp:
            reshard_all(self.module)
        self._sharded = {name: t for name, t in self._registered().items() if is_sharded(t)}
        self._before = self._state()
        wrapped = self._wrapped()  # their contents on every step
        watched = {name: t for name, t in self._watched().items() if contents or id(t) in wrapped}
        self._contents = {name: _fingerprint(t) for name, t in watched.items()}

    def check(self) -> None:
        """Compare with :meth:`start`.

        Raises:
            UnsupportedModuleError: naming each buffer or frozen parameter (and its module) written in place,
                replaced or added since.
        """
        changed = [name for name, state in self._state().items() if self._before.get(name) != state]
        if self._contents:
            current = self._watched()
            changed += [
                name
                for name, before in self._contents.items()
                if name not in changed and name in current and not _same(before, _fingerprint(current[name]))
            ]
            self._contents = {}
        if not changed:
            return
        parts = [name.rpartition(".") for name in changed]
        details = ", ".join(f"'{buffer}' of module '{owner or '<root>'}'" for owner, _, buffer in parts)
        raise UnsupportedModuleError(
            f"buffer(s) or frozen parameter(s) {details} changed during the training forward: a buffer or frozen "
            "parameter written from the data (e.g. a hand-written running mean) is saved in the state_dict without "
            "noise and leaks the training examples; compute the statistic without storing it, make it a trainable "
            "parameter of a supported layer, or update it only outside training (e.g. from public data)"
        )


def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of ``tensor`` (at most :data:`EXACT_COMPARE_NUMEL` elements), else ``[2]`` float64: sum and sum of
    squares."""
    tensor = local_part(tensor).detach()
    if tensor.numel() <= EXACT_COMPARE_NUMEL:
        return tensor.clone()
    values = (torch.view_as_real(tensor) if tensor.is_complex() else tensor).reshape(-1)
    total = torch.zeros(2, dtype=torch.float64, device=tensor.device)
    for chunk in values.split(_CHECKSUM_CHUNK):  # bounded float64 temporaries
        chunk = chunk.to(torch.float64)
        total += torch.stack((chunk.sum(), chunk.square().sum()))
    return total


def _same(before: torch.Tensor, after: torch.Tensor) -> bool:
    """Equal contents (NaN equal to NaN)."""
    if before.shape != after.shape or before.dtype != after.dtype:
        return False
    if before.is_floating_point() or before.is_complex():
        return bool(torch.isclose(before, after, rtol=0.0, atol=0.0, equal_nan=True).all())
    return torch.equal(before, after)
