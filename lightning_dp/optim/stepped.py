"""The parameters a :class:`~lightning_dp.optim.dp_optimizer.DPOptimizer` of this process has stepped, whose values a
ledger counts: a checkpoint's load must replace each of them, or the ledger it brings would count other steps than
the ones they hold (docs/design.md section 2.3)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

#: by ``id`` (a tensor's ``==`` is elementwise, so it cannot be a key of a ``WeakSet``); an entry goes with its tensor.
_STEPPED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def mark_stepped(params: Iterable[torch.Tensor]) -> None:
    """Record that a DP optimizer step updated ``params``."""
    _STEPPED.update((id(p), p) for p in params)


@contextmanager
def replaced_by_load(model: nn.Module) -> Iterator[None]:
    """Around a load of a checkpoint's weights into ``model``: once it returns, every parameter of it that a DP
    optimizer of this process stepped must have been written in place (its version counter moved:
    ``load_state_dict`` copies) or replaced by another tensor, else it keeps weights trained outside the checkpoint's
    ledger (a non-strict load of a checkpoint without it: the HF Trainer's, Lightning's with
    ``strict_loading=False``).

    Raises:
        ValueError: such a parameter kept its value (names listed).
    """
    before = {name: (p, p._version) for name, p in model.named_parameters() if _STEPPED.get(id(p)) is p}
    yield
    after = dict(model.named_parameters())
    kept = [name for name, (p, version) in before.items() if after.get(name) is p and p._version == version]
    if kept:
        raise ValueError(
            f"The checkpoint holds no weights for parameter(s) {', '.join(repr(n) for n in kept[:5])}"
            f"{', ...' if len(kept) > 5 else ''}, which keep what an earlier fit in this process trained, outside the "
            "checkpoint's privacy ledger: resume into a freshly built model, or from a checkpoint that holds them"
        )
