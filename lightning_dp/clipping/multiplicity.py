"""Augmentation multiplicity in the clipper: ``K`` augmented copies of each example, their gradients averaged before
the example is clipped (De, Berrada, Hayes, Smith and Balle 2022, "Unlocking high-accuracy differentially private
image classification through scale", Section 3.2; docs/design.md section 4.8).

The forward sees ``B K`` rows in sample-major order (rows ``i K .. i K + K - 1`` are example ``i``'s copies) and the
per-sample loss is ``[B]``. :func:`fold_copies` turns each capture's per-row terms into per-example terms; the
clipped contribution of each example has norm at most ``C`` whatever ``K``. A copy-major batch bounds nothing; the
batch-independence check reports it (section 9.4).
"""

from __future__ import annotations

import numbers

import torch

from lightning_dp.clipping.layers.registry import UnsupportedModuleError
from lightning_dp.clipping.terms import Factored, Materialised, Term


def validate_multiplicity(augmentation_multiplicity: object) -> None:
    """Check the number of augmented copies per example.

    Raises:
        ValueError: not an integer ``>= 1`` (``bool`` included).
    """
    if (
        isinstance(augmentation_multiplicity, bool)
        or not isinstance(augmentation_multiplicity, numbers.Integral)
        or augmentation_multiplicity < 1
    ):
        raise ValueError(
            "augmentation_multiplicity must be an integer >= 1 (K, the augmented copies of each example whose "
            f"gradients are averaged before clipping; 1 = none), got {augmentation_multiplicity!r}"
        )


def check_rows(name: str, rows: int, batch: int, copies: int, *, folded: bool = False) -> int:
    """The rows of each example in a hooked layer's capture: ``copies`` when ``rows == batch * copies``; with
    ``folded``, any multiple ``rows / batch`` of ``copies`` (a sequence or windows folded into the rows, as OPT's MLP
    and Swin's window attention do), the rows sample-major: the clipper checks that order (docs/design.md section 4.1).

    Args:
        name: the layer's path (for the message).
        rows: the first dimension of its output gradient.
        batch: ``B``, the length of the per-sample loss.
        copies: ``K``.
        folded: whether folded rows are accepted: the capture's input is a reshape of a ``[B K, ...]`` tensor (its
            ``fold_rows``), or an expanded broadcast; never on an FSDP2-sharded model.

    Raises:
        UnsupportedModuleError: another number of rows.
    """
    if rows == batch * copies:
        return copies
    if folded and batch and rows > 0 and rows % (batch * copies) == 0:
        return rows // batch
    if copies == 1:
        raise UnsupportedModuleError(
            f"module '{name}' saw a batch dimension of {rows} but the per-sample loss has {batch} samples; the first "
            "dimension of every layer input must be the sample dimension (expand broadcast inputs to the batch), or "
            "fold each example's rows together: a reshape of a [B, ...] tensor (x.reshape(-1, d)), directly or "
            "through element-wise operations (rows selected by a mask or gathered are not accepted)"
        )
    raise UnsupportedModuleError(
        f"module '{name}' saw {rows} rows but the per-sample loss has {batch} examples: with "
        f"augmentation_multiplicity={copies} every hooked layer must see the {copies} copies of each example, "
        f"{batch * copies} rows in sample-major order (rows i*{copies} .. i*{copies}+{copies - 1} are example i's, as "
        "x.repeat_interleave(K, 0) makes them), and the loss must be one value per example (the mean over its copies, "
        "lightning_dp.augmentation_mean); make the copies before the first hooked layer, or set "
        "augmentation_multiplicity to the number of copies the training step makes"
    )


def fold_copies(term: Term, copies: int) -> Term:
    """The term of each example from the term of its ``copies`` rows (sample-major; exact:
    ``sum_k L_ik^T R_ik = cat_k(L_ik)^T cat_k(R_ik)``).

    Args:
        term: a term of ``B K`` rows: :class:`Materialised` ``[B K, *shape]``, or :class:`Factored` with ``left``
            ``[B K, T, P]`` (ids ``[B K, T]``) and ``right`` ``[B K, T, Q]``.
        copies: ``K >= 1``; ``1`` returns ``term`` itself.

    Returns:
        :class:`Materialised` ``[B, *shape]`` (summed over copies, new tensor), or :class:`Factored` with ``left``
        ``[B, K T, P]`` (ids ``[B, K T]``) and ``right`` ``[B, K T, Q]`` (views of contiguous factors).
    """
    if copies == 1:
        return term
    if isinstance(term, Materialised):
        grad = term.grad
        scales = torch.stack([term.rounding_scales(norm).reshape(-1, copies).sum(1) for norm in (1, 2)])
        return Materialised(grad.reshape(grad.shape[0] // copies, copies, *grad.shape[1:]).sum(1), scales)
    batch = term.right.shape[0] // copies
    left = term.left.reshape(batch, -1, *term.left.shape[2:])
    return Factored(left, term.right.reshape(batch, -1, term.right.shape[-1]), term.shape)
