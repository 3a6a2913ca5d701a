"""Batch independence: example i's loss must not depend on example j's data; one of the run-time checks of
:mod:`lightning_dp.checks`.

:func:`check_batch_independence` tests that the gradient of example i's loss with respect to example j's float input
and hooked layer outputs is zero for i != j, with ``2 ceil(log2 B)`` extra backward passes (one pair of
vector-Jacobian products per bit of the example index); mixing without a gradient path is the job of
:mod:`~lightning_dp.checks.leave_half_out`. The construction, and what the checks cannot see (mixing only on
unchecked batches or in train mode, mixing the leave-half-out variants do not change, gradients that cancel
exactly): docs/design.md section 9.4 and docs/privacy.md, "Run-time checks".
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch.autograd.graph import GradientEdge
from torch.overrides import TorchFunctionMode

from lightning_dp.clipping.layers.registry import UnsupportedModuleError
from lightning_dp.clipping.recomputation import reentrant_refused
from lightning_dp.data.example_lists import EXAMPLE_SEQUENCES

log = logging.getLogger("lightning_dp")

#: relative tolerance of the independence check: gradients across examples must vanish up to rounding.
INDEPENDENCE_RTOL = 1e-6

BATCH_MIXING_HINT = (
    "an operation mixes examples of the batch (e.g. h - h.mean(0), hand-written batch statistics, attention or "
    "pooling over the batch dimension), so clipping each example's gradient no longer bounds its influence; make "
    "every operation act on each example separately. If you are sure the model is per-example (e.g. the coupling is "
    "in a non-trainable diagnostic), switch the check off with check_batch_independence=False"
)

#: Prefixed to the hint when a layer output of ``B K`` rows showed the dependence (augmentation multiplicity).
COPIES_HINT = (
    "with augmentation_multiplicity={k}, rows i*{k} .. i*{k}+{k}-1 of every layer must be example i's copies (make "
    "them with x.repeat_interleave({k}, 0), not x.repeat({k}, ...), and average each example's own rows); otherwise "
)


class BatchMixingError(UnsupportedModuleError):
    """Example i's loss depends on example j's data (i != j): the per-sample sensitivity bound does not hold."""


def input_leaves(batch: Any, batch_size: int) -> tuple[Any, dict[str, torch.Tensor]]:
    """The batch with every floating-point tensor of first dimension ``batch_size`` replaced by a clone of a fresh
    leaf that requires grad (a clone, so the user's in-place ops on it stay legal), and those leaves by position.
    Run the forward on it under :class:`InputsRequireGrad`.

    Returns:
        ``(batch, {"input 0": leaf [B, ...], ...})``; the batch unchanged when it has no such tensor.
    """
    leaves: dict[str, torch.Tensor] = {}

    def as_leaf(tensor: Any) -> Any:
        if not isinstance(tensor, torch.Tensor):  # a marked per-example sequence: its tensors are not rows
            return tensor
        if not tensor.is_floating_point() or tensor.ndim == 0 or tensor.shape[0] != batch_size:
            return tensor
        leaf = tensor.detach().requires_grad_(True)
        leaves[f"input {len(leaves)}"] = leaf
        return leaf.clone()

    return apply_to_collection(batch, (torch.Tensor, *EXAMPLE_SEQUENCES), as_leaf), leaves


_SET_REQUIRES_GRAD = torch.Tensor.requires_grad.__set__  # type: ignore[attr-defined]


class InputsRequireGrad(TorchFunctionMode):
    """Under it, ``t.requires_grad = True`` on a tensor that already requires grad is a no-op, as on a leaf (torch
    refuses it on a non-leaf such as the clones of :func:`input_leaves`; docs/design.md section 9.4)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func == _SET_REQUIRES_GRAD and args[1] is True and args[0].requires_grad:
            return None
        return func(*args, **(kwargs or {}))


def _example_rows(shape: torch.Size, batch: int, copies: int) -> bool:
    """Whether a target of ``shape`` has one row per example (``B``), one per copy with augmentation multiplicity
    (``B K``, sample-major: rows ``i K .. i K + K - 1`` are example ``i``'s), or a multiple of ``B K`` rows (a sequence
    or windows folded into the rows, sample-major; the clipper's ``multiplicity.check_rows``)."""
    if len(shape) == 0 or batch == 0:
        return False
    return shape[0] == batch or (shape[0] > 0 and shape[0] % (batch * copies) == 0)


def check_batch_independence(
    per_sample_loss: torch.Tensor,
    targets: dict[str, tuple[GradientEdge | torch.Tensor, torch.Size]],
    copies: int = 1,
) -> bool:
    """Fail when example i's loss has a nonzero gradient with respect to example j's part of a target, i != j.

    Runs ``2 ceil(log2 B)`` vector-Jacobian products of the per-sample loss (graph retained, nothing written to
    ``.grad``). Logs a warning, and checks nothing, when no target has ``B`` rows or the loss has no gradient.

    Args:
        per_sample_loss: ``[B]``, attached to the graph of the training forward.
        targets: ``{description: (edge or tensor, shape)}`` with the sample dimension first (hooked layer outputs,
            float input leaves); targets whose first dimension is neither ``B`` nor ``B K`` are skipped.
        copies: ``K``, the augmentation multiplicity: a target of ``B K`` rows is example ``i``'s in rows
            ``i K .. i K + K - 1`` (a copy-major order then shows as mixing).

    Returns:
        Whether the check was conclusive: False when a per-sample loss is not finite (the caller checks again on a
        later batch).

    Raises:
        BatchMixingError: naming a pair (i, j) and the first target where the dependence shows.
    """
    batch = per_sample_loss.shape[0]
    targets = {name: t for name, t in targets.items() if _example_rows(t[1], batch, copies)}
    if batch < 2:
        return True
    if not targets or not per_sample_loss.requires_grad:
        why = (
            "the per-sample loss has no gradient"
            if targets
            else f"no hooked layer output or float input has the batch size {batch} as its first dimension"
        )
        log.warning(
            "batch-independence check could not run (%s), so mixing of examples in the model is NOT checked; "
            "make sure every operation acts on each example separately",
            why,
        )
        return True
    conclusive, error = _vector_jacobian_passes(
        per_sample_loss, targets, bits=math.ceil(math.log2(batch)), active=True, copies=copies
    )
    if error is not None:
        raise error
    return conclusive


def _vector_jacobian_passes(
    per_sample_loss: torch.Tensor,
    targets: dict[str, tuple[GradientEdge | torch.Tensor, torch.Size]],
    *,
    bits: int,
    active: bool,
    copies: int = 1,
) -> tuple[bool, BatchMixingError | None]:
    """``2 bits`` vector-Jacobian products of the per-sample loss to every target; with ``active``, the first leak
    into a target with ``B`` rows is returned (after all passes ran: the passes of a sharded model are collectives).
    Inactive, the weights are zero: the passes only run the backward (see :func:`check_batch_independence_in_step`).
    Returns whether every loss is finite, and the leak found (or ``None``)."""
    error: BatchMixingError | None = None
    batch = per_sample_loss.shape[0]
    names = list(targets)
    inputs = [targets[name][0] for name in names]
    checked = [name for name in names if _example_rows(targets[name][1], batch, copies)]
    index = torch.arange(batch, device=per_sample_loss.device)
    finite = torch.isfinite(per_sample_loss.detach())
    for bit in range(bits):
        member = ((index >> bit) & 1).bool()
        for chosen in (member, ~member):
            weighted = chosen & finite if active else torch.zeros_like(chosen)
            with torch.enable_grad(), reentrant_refused():
                grads = torch.autograd.grad(
                    per_sample_loss,
                    inputs,  # type: ignore[arg-type]  # a mix of tensors and edges: torch accepts it, its stub does not
                    grad_outputs=weighted.to(per_sample_loss.dtype),
                    retain_graph=True,
                    allow_unused=True,
                )
            if active and error is None:
                by_name = dict(zip(names, grads, strict=True))
                try:
                    grads_checked = [by_name[n] for n in checked]
                    _raise_on_leak(checked, grads_checked, [targets[n][1] for n in checked], weighted, copies)
                except BatchMixingError as leak:
                    error = leak
    return bool(finite.all()), error


def check_batch_independence_in_step(
    per_sample_loss: torch.Tensor,
    targets: dict[str, tuple[GradientEdge | torch.Tensor, torch.Size]],
    *,
    active: bool,
    bits: int,
    copies: int = 1,
) -> tuple[bool, BatchMixingError | None]:
    """:func:`check_batch_independence` in lockstep with the other ranks, for a sharded (FSDP2) model.

    Every rank runs the same number of passes (the largest ``ceil(log2 B)`` over the ranks) to all hooked layer
    outputs; a rank with ``active`` False (not pending, or fewer than two examples) passes zero weights.

    Returns:
        ``(conclusive, error)``: the error is returned, not raised, so the ranks can agree before raising.
    """
    return _vector_jacobian_passes(per_sample_loss, targets, bits=bits, active=active, copies=copies)


def _raise_on_leak(
    names: Iterable[str],
    grads: Iterable[torch.Tensor | None],
    shapes: Iterable[torch.Size],
    weighted: torch.Tensor,
    copies: int = 1,
) -> None:
    """Raise when an example outside ``weighted`` has a gradient above the relative tolerance in its rows.

    A NaN entry counts as zero (an example with a non-finite loss, given weight 0, gets ``0 * inf``: neither failing
    the check, which would reveal that it was drawn, nor hiding others' leaks); an infinite entry counts as the
    largest float.
    """
    for name, grad, shape in zip(names, grads, shapes, strict=True):
        if grad is None:
            continue
        largest = torch.finfo(torch.float32).max
        by_example = grad.reshape(shape).reshape(weighted.shape[0], -1)  # [B K, ...] -> [B, K ...]: sample-major
        rows = by_example.abs().float().nan_to_num(0.0, largest, largest).amax(dim=1)
        inside, outside = rows[weighted], rows[~weighted]
        scale = float(inside.max()) if inside.numel() else 0.0
        scale = min(scale, largest / INDEPENDENCE_RTOL)
        if outside.numel() and float(outside.max()) > INDEPENDENCE_RTOL * max(scale, 1e-30):
            j = int(torch.nonzero(~weighted)[int(outside.argmax())])
            order = COPIES_HINT.format(k=copies) if copies > 1 else ""
            raise BatchMixingError(
                f"batch-independence check: the losses of other examples have a nonzero gradient with respect to "
                f"example {j}'s {name} (largest |gradient| {float(outside.max()):.3g}); " + order + BATCH_MIXING_HINT
            )
