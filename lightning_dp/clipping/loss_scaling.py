"""The clipper's own, fixed loss scale for float16 backwards (docs/privacy.md, "Mixed precision").

Under float16 autocast the clipper's backward (one ``torch.autograd.grad`` of ``S sum_i loss_i`` to the captured
output edges) runs with a fixed power of two ``S``, so that small per-example output gradients do not underflow in
float16. Everything the clipper forms from the captures is linear in the output gradients, so the unscaling is exact
(a power of two) and done in the float32 per-sample arithmetic: squared l2 norms are divided by ``S^2`` (l1: by
``S``), their bounds (rounding included) by ``S`` once formed, and the clip factors of the clipped sum by ``S``. An
example whose scaled output gradient overflows float16 has a non-finite norm and is dropped like any non-finite
example (factor 0, ``dropped_nonfinite``).

``S`` is a constant, never adapted to overflows: which examples are dropped is then a function of each example alone
(and of the public model), and nothing about it is released but through the noised sum. The trainer's own
``GradScaler`` never sees a per-example gradient (:mod:`lightning_dp.engine.grad_scaler`).
"""

from __future__ import annotations

import math

import torch

#: The loss scale of the clipper's backward under float16 (Lightning ``precision="16-mixed"``, HF ``fp16=True``).
#: The clipper backpropagates the SUM of per-example losses, so each example's output gradients carry ``S`` once (a
#: mean loss under a GradScaler of scale ``S'`` carries ``S' / B``): ``2^8`` leaves a factor ``256`` below float16's
#: largest value (65504) for an example's output-gradient entries, and moves float16's smallest subnormal (``2^-24``)
#: down to ``2^-32`` in unscaled units.
FP16_LOSS_SCALE = 2.0**8


def validate_loss_scale(scale: float) -> float:
    """``scale`` as a float when it is a positive, finite power of two (so that unscaling is exact).

    Raises:
        ValueError: anything else (``bool`` included).
    """
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"loss_scale must be a positive finite power of two, got {scale!r}")
    if math.frexp(float(scale))[0] != 0.5:
        raise ValueError(f"loss_scale must be a power of two (exact unscaling), got {scale!r}")
    return float(scale)


def unscale_norms(totals: torch.Tensor, loss_scale: float, norm: int) -> torch.Tensor:
    """The per-sample norms ``totals`` ``[G, B]`` of a backward scaled by ``loss_scale`` (``S``, a power of two; 1:
    returned unchanged), squared l2 (``norm=2``) or l1, in unscaled units: ``totals / S^2`` or ``totals / S``; exact
    unless a value is subnormal, a non-finite value stays non-finite."""
    if loss_scale == 1.0:
        return totals
    return totals / (loss_scale**2 if norm == 2 else loss_scale)


def unscale_linear(values: torch.Tensor, loss_scale: float) -> torch.Tensor:
    """``values / S`` ``[G, B]`` (``S = loss_scale``; 1: returned unchanged), for what is linear in the scaled output
    gradients: the norm bounds ``nu`` (:func:`~.rounding.rounded_norm_bound`) in unscaled units, formed in the scaled
    units first (their share ``r S^2`` of an unscaled squared scale could be subnormal, and flushed to zero under
    ``torch.set_flush_denormal(True)``); and the clip factors applied to the scaled terms, which then give the clipped
    sum of the unscaled per-example gradients (``c_i grad_i = (c_i / S) (S grad_i)``)."""
    return values if loss_scale == 1.0 else values / loss_scale


class LossScaleMixin:
    """The clipper's :attr:`loss_scale` (a base of :class:`~lightning_dp.clipping.clipper.PerSampleClipper`)."""

    _loss_scale: float = 1.0

    @property
    def loss_scale(self) -> float:
        """``S``, the fixed scale of the clipper's backward (1: none; :data:`FP16_LOSS_SCALE` under float16); the norms
        it returns and the clipped sum it adds are in unscaled units whatever ``S``. Set it between batches (a batch's
        past iterates and its backward must share it).

        Raises:
            ValueError: (setting) not a positive finite power of two.
        """
        return self._loss_scale

    @loss_scale.setter
    def loss_scale(self, scale: float) -> None:
        self._loss_scale = validate_loss_scale(scale)
