"""Rounding in the per-sample arithmetic (docs/design.md section 4.10): the rounding bound of the clip factors, the
full precision it assumes, and the warning for FSDP2-sharded 16-bit parameters.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterable, Iterator

import torch

from lightning_dp.runtime.sharding import is_sharded

log = logging.getLogger("lightning_dp")

#: Rounding allowance in float32/float64 arithmetic, in units of the dtype's machine epsilon, per unit of rounding
#: scale (the clip factors' bound and :meth:`~.sum_check.SumCheck.add`).
ROUNDING_EPSILONS = 128


@contextlib.contextmanager
def full_precision(device: torch.device) -> Iterator[None]:
    """The per-sample arithmetic in the terms' own dtype: autocast off on ``device`` and float32 matmuls at
    ``"highest"`` precision (no TF32), restored afterwards.
    """
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.autocast(device.type, enabled=False):
            yield
    finally:
        torch.set_float32_matmul_precision(precision)


def rounded_norm_bound(totals: torch.Tensor, scales: torch.Tensor, norm: int, epsilon: float) -> torch.Tensor:
    """``nu_gi`` ``[G, B]``: an upper bound on the norm of what the clipped sum adds for sample ``i`` in group ``g``,
    rounding included (docs/design.md section 4.10).

    With ``r = 128 epsilon``: ``nu = sqrt(n^2 + r s^2) + r s`` for ``norm=2``, ``nu = n + 2 r s`` for ``norm=1``; a
    non-finite bound is ``inf`` (factor 0).

    Args:
        totals: ``[G, B]``, squared l2 norms (``norm=2``, not negative) or l1 norms.
        scales: ``[G, B]``, the squared rounding scales (``norm=2``) or the scales (``norm=1``).
        norm: 2 or 1.
        epsilon: the machine epsilon of the per-sample arithmetic.
    """
    r = ROUNDING_EPSILONS * epsilon
    bound = (totals + r * scales).sqrt() + r * scales.sqrt() if norm == 2 else totals + 2 * r * scales
    return torch.nan_to_num(bound, nan=math.inf, posinf=math.inf)


#: The multiple of the underflow bound ``a^2`` that the clip factors' bound covers: two paths to one example's norm (a
#: Gram product or a materialised gradient, chosen by the padded length) can lose different amounts to underflow, up
#: to ``a^2`` each, which then moves its factor by at most a relative ``2^-20``.
UNDERFLOW_MARGIN = 2.0**20


def underflow_scale(underflow: torch.Tensor, epsilon: float) -> torch.Tensor:
    """The squared rounding scale ``K a^2 / r`` (``K =`` :data:`UNDERFLOW_MARGIN`, ``r = 128 epsilon``) whose share
    ``r S^2`` of the bound (:func:`rounded_norm_bound`) is ``K a^2``: ``underflow`` ``[B]``, a bound ``a^2`` on what
    underflow took from a squared norm (:func:`~lightning_dp.clipping.underflow.underflow_bound`), in the units of the
    squared scales.
    """
    return underflow * (UNDERFLOW_MARGIN / (ROUNDING_EPSILONS * epsilon))


#: Logged once per clipper whose trainable parameters include FSDP2-sharded ones in a 16-bit dtype (``%s``: the
#: dtypes). Unsharded 16-bit parameters keep their clipped sum in float32 (:mod:`~.float32_sums`) and are cast only
#: after the noise, which is post-processing; sharded ones still round the sum into their ``.grad``.
HALF_PRECISION_WARNING = (
    "FSDP2-sharded trainable parameters in %s: the clipped sum is formed in float32, but it and the noise are "
    "rounded to that dtype in their sharded .grad (relative 2^-8 per coordinate in bfloat16): the rounding of the "
    "whole batch's sum can move the release by more than max_grad_norm and the noise is quantised, so the reported "
    "epsilon does not hold exactly for them (secure_mode's noise neither). Train float32 parameters (bf16-mixed "
    "autocast keeps them) or unsharded ones when it must"
)


def warn_if_half_precision(params: Iterable[torch.Tensor]) -> None:
    """Log :data:`HALF_PRECISION_WARNING` when any of ``params`` is bfloat16 or float16 and FSDP2-sharded (an unsharded
    one keeps a float32 clipped sum, :mod:`~.float32_sums`; docs/privacy.md)."""
    half = sorted({str(p.dtype) for p in params if p.dtype in (torch.bfloat16, torch.float16) and is_sharded(p)})
    if half:
        log.warning(HALF_PRECISION_WARNING, ", ".join(half))
