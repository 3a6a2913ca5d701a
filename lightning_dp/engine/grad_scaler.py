"""float16 training under the trainer's ``GradScaler`` (Lightning ``precision="16-mixed"``, HF ``fp16=True``;
docs/privacy.md, "Mixed precision"). Imports neither Lightning nor transformers.

The adapters never backpropagate the scaled loss: the clipper runs its own backward at its own fixed scale
(:mod:`lightning_dp.clipping.loss_scaling`), drops the examples that overflow, and writes the clipped sum in unscaled
float32 units; the noise is added to it there. The trainer's ``GradScaler`` then expects scaled gradients: its
``unscale_`` divides ``.grad`` by its scale ``S`` and its ``step`` skips the update when a result is not finite. So
:func:`hand_to_grad_scaler` multiplies the noised gradient by ``S`` right after it is formed: ``unscale_`` gives the
noised gradient back, which is finite (the finite check of the clipped sums reads at every step under a scaler,
:func:`read_finite_flags_every_step`), so the scaler finds no overflow, never skips the step and never lowers ``S``;
``S`` only grows every ``growth_interval`` steps, a schedule that depends on no data. Whatever the scaler does with
``.grad`` is post-processing of the noised gradient.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from lightning_dp.clipping.loss_scaling import FP16_LOSS_SCALE
from lightning_dp.runtime.sharding import local_part

if TYPE_CHECKING:
    from lightning_dp.engine.privacy_engine import PrivacyEngine
    from lightning_dp.optim.dp_optimizer import DPOptimizer

log = logging.getLogger("lightning_dp")

#: The largest scale :func:`hand_to_grad_scaler` lets the trainer's ``GradScaler`` reach. Never finding an overflow,
#: the scaler doubles its scale every ``growth_interval`` steps without end (float32's infinity after 112 doublings
#: from ``2^16``, where ``unscale_`` would zero every gradient); capped here, on no data.
MAX_GRAD_SCALE = 2.0**64


def scale_clipper_backward(engine: PrivacyEngine, scale: float = FP16_LOSS_SCALE) -> None:
    """Run the clipper's backward at the fixed loss ``scale`` (float16 training), once the clipper is attached.

    Raises:
        RuntimeError: no clipper attached (call after ``start_run``).
        ValueError: ``scale`` not a positive finite power of two.
    """
    clipper = engine.state.clipper
    if clipper is None:
        raise RuntimeError("scale_clipper_backward needs the clipper: call it after PrivacyEngine.start_run")
    clipper.loss_scale = scale
    log.info(
        "float16 training: the per-example backward runs at a fixed loss scale of %g, unscaled in float32 before "
        "clipping; examples whose scaled gradient overflows float16 are dropped (docs/privacy.md, 'Mixed precision')",
        scale,
    )


def hand_to_grad_scaler(params: Sequence[torch.nn.Parameter], scaler: Any) -> None:
    """``p.grad *= S`` for every parameter with a gradient, ``S`` the current scale of ``scaler`` (a
    ``torch.amp.GradScaler``), so that its ``unscale_`` gives the noised gradient back. No host sync.

    The scaler's scale is first capped at :data:`MAX_GRAD_SCALE` (in place). A product above the dtype's largest
    value is clamped to it (an entry above ``max / S`` of the noised gradient, about ``1.8e19`` in float32 at the
    scale ``2^64``), so the scaler never sees an overflow and never skips a step that was noised (and recorded). A
    disabled scaler changes nothing; a scaler that has not scaled a loss yet (DPTrainer never backpropagates through
    it) gets its scale initialised first.

    Args:
        params: the trainable parameters, the noised gradient in ``.grad``.
        scaler: the trainer's ``GradScaler``.
    """
    if not scaler.is_enabled():
        return
    grads = [local_part(p.grad) for p in params if p.grad is not None]  # a sharded gradient: this rank's shard
    if not grads:
        return
    if scaler._scale is None:  # lazily created by GradScaler.scale, which only the scaled loss's backward calls
        scaler.scale(torch.zeros((), device=grads[0].device))
    scale: torch.Tensor = scaler._scale.clamp_(max=MAX_GRAD_SCALE)
    for grad in grads:
        largest = torch.finfo(grad.dtype).max
        grad.mul_(scale.to(grad.device, grad.dtype)).clamp_(-largest, largest)


def read_finite_flags_every_step(optimizer: DPOptimizer) -> None:
    """Make ``optimizer`` read its finite check at every step (``finite_check_every = 1``), so that a non-finite clipped
    sum raises before the noise and the scaler never sees one: a deferred check would divide that step's gradient by
    NaN, which the scaler would skip and answer by halving its scale instead of the NaN model the deferred check
    relies on. The scaler's own step reads its overflow flag from the device at every step, so this adds little."""
    optimizer.finite_check_every = 1


def hand_skipped_step_to_grad_scaler(params: Sequence[torch.nn.Parameter], scaler: Any) -> None:
    """A step the optimizer skips (the privacy budget is spent: nothing clipped or noised): zero gradients for
    ``params``, handed to ``scaler`` (:func:`hand_to_grad_scaler`), so that the trainer's scaler step has gradients
    to unscale (without them its ``unscale_`` raises) and finds no overflow; the optimizer then skips the update."""
    for param in params:
        param.grad = torch.zeros_like(param)
    hand_to_grad_scaler(params, scaler)


def handing_to_grad_scaler(
    closure: Callable[[], Any],
    params: Callable[[], Sequence[torch.nn.Parameter]],
    scaler: Any,
    skip: Callable[[], bool],
) -> Callable[[], Any]:
    """``closure`` (which ends with the noise) followed by :func:`hand_to_grad_scaler` on ``params()``, or by
    :func:`hand_skipped_step_to_grad_scaler` when ``skip()`` (the optimizer takes no step).

    A closure that returns ``None`` (the user's step skipped its batch, or the budget is spent) returns a zero tensor
    instead: Lightning's mixed-precision plugin skips the optimizer step on ``None``, after the gradient was noised,
    and the step would not be recorded; without a scaler the step is taken and recorded, and so it is here (other
    precision plugins, FSDP's, unscale whatever the closure returns).
    """

    def closure_then_scale() -> Any:
        result = closure()
        if skip():
            hand_skipped_step_to_grad_scaler(params(), scaler)
        else:
            hand_to_grad_scaler(params(), scaler)
        return torch.zeros(()) if result is None else result

    return closure_then_scale
