"""Whether a checkpoint's load wrote every trainable weight of the model: its ledger counts the steps that produced the
weights it holds, not those of a weight it left as it was (docs/design.md section 2.3)."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager

from torch import nn


def _refusal(names: list[str]) -> ValueError:
    return ValueError(
        f"The checkpoint's load did not write trainable parameter(s) {', '.join(repr(n) for n in names[:5])}"
        f"{', ...' if len(names) > 5 else ''}, so they would keep weights its privacy ledger does not count: resume "
        "from a checkpoint of this model that holds every trainable parameter, loaded by load_state_dict"
    )


@contextmanager
def trainable_weights_written(model: nn.Module) -> Iterator[None]:
    """Around an adapter's load of a checkpoint's weights into ``model`` (with the checkpoint's privacy state): once it
    returns, every parameter of ``model`` that requires grad must have been written: copied into in place (its
    version counter moved, as ``load_state_dict`` does) or replaced by another tensor. Else it holds weights the
    checkpoint does not (a non-strict load of a checkpoint without it: the HF Trainer's, Lightning's with
    ``strict_loading=False``), which its ledger does not count: an earlier fit's, a copy of trained weights, another
    process's. A write through ``param.data`` is not seen (it keeps the version counter), so it is refused.

    Raises:
        ValueError: a trainable parameter kept its value (names listed).
    """
    before = {name: (p, p._version) for name, p in model.named_parameters() if p.requires_grad}
    # strong references for the load only: none may outlive it (``swap_tensors`` refuses a tensor with a weak one)
    yield
    after = dict(model.named_parameters())
    kept = [name for name, (p, version) in before.items() if after.get(name) is p and p._version == version]
    if kept:
        raise _refusal(kept)


def check_checkpoint_keys(model: nn.Module, keys: Collection[str]) -> None:
    """Refuse a checkpoint whose weights (``keys``, the names of its state dict) lack a trainable parameter of
    ``model``, for loads that write a missing weight with its own value (Lightning's non-strict load of one
    checkpoint file into an FSDP2-sharded model).

    Raises:
        ValueError: a trainable parameter is not among ``keys`` (names listed).
    """
    missing = [name for name, p in model.named_parameters() if p.requires_grad and name not in keys]
    if missing:
        raise _refusal(missing)
