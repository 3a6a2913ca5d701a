"""Captures of calls inside activation-checkpointed regions: the call's input comes from the recomputed forward.

Under non-reentrant activation checkpointing (``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, HF
``gradient_checkpointing=True``, torch's ``checkpoint_wrapper`` under Lightning or FSDP2) the forward keeps no
activation of a checkpointed region; the backward recomputes them. Inside such a region (seen as active saved-tensors
hooks, which also covers ``torch.autograd.graph.save_on_cpu``) a hooked call's differentiable outputs pass through
:class:`SaveInput`, an identity whose autograd node saves the call's first input through those hooks: the forward keeps
a handle, the recomputation refills it, and the node's backward, which every backward that reaches the layer's output
edge through the call's outputs runs, hands the recomputed input to the capture (docs/design.md section 4.1). Calls of
hooked modules during a recomputation (inside a backward) make no capture but pass their outputs through the same
identity, so that both passes save the same tensors, as checkpointing requires.

Reentrant checkpointing (``use_reentrant=True``) runs the region without gradients and its own backward inside the outer
one; ``torch.autograd.grad`` to the captured edges cannot traverse it (:data:`REENTRANT_MESSAGE`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

#: What the clipper says when torch refuses a reentrant checkpointed region in its backward.
REENTRANT_MESSAGE = (
    "reentrant activation checkpointing (use_reentrant=True) hides the checkpointed layers from the per-sample "
    "clipping: checkpoint with use_reentrant=False (torch.utils.checkpoint.checkpoint(..., use_reentrant=False); HF: "
    "gradient_checkpointing_kwargs={'use_reentrant': False}, the default in transformers 5)"
)


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensors hooks are active (a checkpointed forward, its recomputation, ``save_on_cpu``)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def recomputing() -> bool:
    """Whether a forward runs inside a backward: a checkpointed region's recomputation."""
    return torch._C._current_graph_task_id() != -1


@contextmanager
def reentrant_refused() -> Iterator[None]:
    """Around a ``torch.autograd.grad``: torch's refusal to run it through a reentrant checkpoint becomes a
    ``ValueError`` saying what to change (:data:`REENTRANT_MESSAGE`)."""
    try:
        yield
    except RuntimeError as error:
        if "use_reentrant=True" in str(error):
            raise ValueError(REENTRANT_MESSAGE) from error
        raise


class SaveInput(torch.autograd.Function):
    """Identity on a call's differentiable outputs (each returned as a copy: in-place operations on a custom
    function's returned input are refused) whose node saves the call's first input ``x`` ``[R, ...]`` through the
    active saved-tensors hooks; its backward, which runs when any of the outputs gets a gradient, passes ``x``
    (recomputed under checkpointing) to ``sink`` when one is given. All the outputs pass through it, not only the
    hooked one: a router's logits reach the loss only through the scores it computes from them inside its call."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, sink: Callable[[torch.Tensor], None] | None, *outputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.save_for_backward(x)
        ctx.sink = sink
        ctx.set_materialize_grads(False)
        return tuple(output.clone() for output in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        if ctx.sink is not None:
            ctx.sink(x)
        return (None, None, *grads)


def save_input(
    outputs: list[torch.Tensor], x: torch.Tensor, sink: Callable[[torch.Tensor], None] | None = None
) -> list[torch.Tensor]:
    """``outputs`` (a call's differentiable outputs) through one :class:`SaveInput` saving ``x`` (detached), with the
    capture's ``sink`` (None during a recomputation)."""
    result = SaveInput.apply(x.detach(), sink, *outputs)
    assert isinstance(result, tuple)
    return list(result)
