"""Whether a checkpoint's load wrote every trainable weight of the model: its ledger counts the steps that produced the
weights it holds, not those of a weight it left as it was (docs/design.md section 2.3)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def _storage(param: torch.Tensor) -> int | None:
    """Where ``param``'s data lives (``None`` where a tensor subclass has no pointer of its own, e.g. a DTensor)."""
    try:
        return param.data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


@contextmanager
def trainable_weights_written(model: nn.Module) -> Iterator[None]:
    """Around an adapter's load of a checkpoint's weights into ``model`` (with the checkpoint's privacy state): once it
    returns, every parameter of ``model`` that requires grad must have been written: copied into in place (its
    version counter moved, as ``load_state_dict`` does), given other data, or replaced by another tensor. Else it
    holds weights the checkpoint does not (a non-strict load of a checkpoint without it: the HF Trainer's,
    Lightning's with ``strict_loading=False``), which its ledger does not count: an earlier fit's, a copy of trained
    weights, another process's.

    Raises:
        ValueError: a trainable parameter kept its value (names listed).
    """
    before = {
        name: (p, p._version, _storage(p)) for name, p in model.named_parameters() if p.requires_grad
    }  # strong references for the load only: nothing may hold one past it (``swap_tensors`` refuses weak ones)
    yield
    after = dict(model.named_parameters())
    kept = [
        name
        for name, (p, version, storage) in before.items()
        if after.get(name) is p and p._version == version and _storage(p) == storage
    ]
    if kept:
        raise ValueError(
            f"The checkpoint holds no weights for trainable parameter(s) {', '.join(repr(n) for n in kept[:5])}"
            f"{', ...' if len(kept) > 5 else ''}, so they would keep weights its privacy ledger does not count: resume "
            "from a checkpoint of this model that holds every trainable parameter"
        )
