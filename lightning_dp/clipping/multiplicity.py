"""Augmentation multiplicity in the clipper: ``K`` augmented copies of each example, their gradients averaged BEFORE
the example is clipped (De, Berrada, Hayes, Smith and Balle 2022, "Unlocking high-accuracy differentially private
image classification through scale", Section 3.2; docs/design.md section 4.8).

With ``augmentation_multiplicity = K`` the model's forward sees ``B * K`` rows in SAMPLE-MAJOR order: rows
``i K .. i K + K - 1`` are example ``i``'s copies (``x.repeat_interleave(K, 0)`` followed by a per-row augmentation),
and the per-sample loss is ``[B]``, example ``i``'s loss ``loss_i`` a reduction of its copies' losses (De et al.: the
mean, :func:`lightning_dp.augmentation.augmentation_mean`). So every hooked layer's capture has ``B K`` rows, and the
output gradients of ``sum_i loss_i`` already carry the reduction's weights (``1/K`` for the mean). A layer family
turns a capture into terms as if each row were a sample; :func:`fold_copies` then makes them the terms of the
``B`` examples:

- a factored term ``L^T R`` (``L`` ``[B K, T, P]`` or ids ``[B K, T]``, ``R`` ``[B K, T, Q]``) becomes one of
  ``K T`` rows per example (``[B, K T, P]``, ``[B, K T, Q]``): a view (no copy for contiguous factors), exact since
  ``sum_k L_ik^T R_ik = cat_k(L_ik)^T cat_k(R_ik)``;
- a materialised term ``[B K, *shape]`` is summed over each example's ``K`` rows (``[B, *shape]``).

Each engine then sees, per example, the terms of the gradient of ``loss_i`` itself, the sum over its copies, cross
terms between copies included, exactly as it sees the uses of a tied parameter (section 4.5): the norms, the clip
factors ``c_i``, book-keeping's clipped sum, the sum check and the masking of non-finite examples are unchanged, and
example ``i``'s clipped contribution ``c_i grad(loss_i)`` has norm at most ``C`` whatever ``K``: the sensitivity,
the noise and the accounting are those of ``K = 1``. The randomized engines estimate the norm of the same per-example
matrix ``grad(loss_i)``, so the ``rc`` accountant's bound (which holds for any matrix) is unchanged.

The row ORDER matters: folding groups rows ``i K .. i K + K - 1``. A copy-major batch (``x.repeat(K, 1, ...)``)
would group copies of different examples into one "example", clip them together, and bound nothing; the
batch-independence check (section 9.4, which groups the rows of a layer output the same way) reports it as mixing
on the first step.
"""

from __future__ import annotations

import numbers

import torch

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


def check_rows(name: str, rows: int, batch: int, copies: int) -> None:
    """Check that a hooked layer's capture has one row per copy of each example: ``rows == batch * copies``.

    Args:
        name: the layer's path in the model (for the message).
        rows: the first dimension of its output gradient.
        batch: ``B``, the length of the per-sample loss.
        copies: ``K``.

    Raises:
        ValueError: another number of rows, with what to change.
    """
    if rows == batch * copies:
        return
    if copies == 1:
        raise ValueError(
            f"module '{name}' saw a batch dimension of {rows} but the per-sample loss has {batch} samples; the first "
            "dimension of every layer input must be the sample dimension (expand broadcast inputs to the batch)"
        )
    raise ValueError(
        f"module '{name}' saw {rows} rows but the per-sample loss has {batch} examples: with "
        f"augmentation_multiplicity={copies} every hooked layer must see the {copies} copies of each example, "
        f"{batch * copies} rows in sample-major order (rows i*{copies} .. i*{copies}+{copies - 1} are example i's, as "
        "x.repeat_interleave(K, 0) makes them), and the loss must be one value per example (the mean over its copies, "
        "lightning_dp.augmentation_mean); make the copies before the first hooked layer, or set "
        "augmentation_multiplicity to the number of copies the training step makes"
    )


def fold_copies(term: Term, copies: int) -> Term:
    """The term of each example from the term of its ``copies`` rows (sample-major; see the module docstring).

    Args:
        term: a layer family's term of a capture of ``B * copies`` rows: :class:`Materialised` ``[B K, *shape]``,
            or :class:`Factored` with ``left`` ``[B K, T, P]`` (ids ``[B K, T]``) and ``right`` ``[B K, T, Q]``.
        copies: ``K >= 1``; ``1`` returns ``term`` itself.

    Returns:
        The term of the ``B`` examples' gradients, each the sum over its copies: :class:`Materialised`
        ``[B, *shape]`` (a new tensor), or :class:`Factored` with ``left`` ``[B, K T, P]`` (ids ``[B, K T]``) and
        ``right`` ``[B, K T, Q]`` (views of contiguous factors).
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
