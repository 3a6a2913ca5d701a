"""The per-sample sum check: each parameter's per-sample gradients must sum to its autograd gradient (docs/design.md
section 9.3).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from lightning_dp.clipping.hooks import Capture
from lightning_dp.clipping.rounding import ROUNDING_EPSILONS
from lightning_dp.clipping.terms import Term, batch_sum

#: Relative tolerance of the sum check in float32/float64 arithmetic.
VERIFY_RTOL = 1e-3
#: Relative tolerance under reduced-precision arithmetic (fp16/bf16 autocast or parameters, TF32 on CUDA).
VERIFY_RTOL_REDUCED = 5e-2
#: Rounding allowance per unit of rounding scale under reduced precision (about 5 bfloat16 unit roundoffs).
ROUNDING_RTOL_REDUCED = 1e-2
_REDUCED_DTYPES = (torch.float16, torch.bfloat16)


def reduced_precision(per_sample_loss: torch.Tensor, params: list[nn.Parameter], captures: list[Capture]) -> bool:
    """Whether this step's gradients were computed with 10 or fewer mantissa bits somewhere: fp16/bf16 autocast (now, or
    seen in the captures or loss), fp16/bf16 parameters, or float32 CUDA parameters with TF32 matmuls, or TF32
    convolutions and a hooked convolution.
    """
    if per_sample_loss.dtype in _REDUCED_DTYPES or torch.is_autocast_enabled(per_sample_loss.device.type):
        return True
    if any(p.dtype in _REDUCED_DTYPES for p in params):
        return True
    if any(t is not None and t.dtype in _REDUCED_DTYPES for c in captures for t in (c.activation, c.output_grad)):
        return True
    if any(p.is_cuda and p.dtype == torch.float32 for p in params):
        if torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest":
            return True
        if torch.backends.cudnn.allow_tf32 and any(isinstance(c.module, nn.modules.conv._ConvNd) for c in captures):
            return True
    return False


class SumCheck:
    """Per-step check that each parameter's per-sample gradients sum to its autograd gradient.

    Parameter ``p`` fails when ``||ours_p - ref_p|| > rtol * (max(||ours_p||, ||ref_p||) + G / sqrt(k)) + r * S_p``:
    ``ours_p`` the batch sum of its terms, ``ref_p`` the autograd gradient of ``sum_i loss_i``, ``G`` the joint norm
    of the ``max(...)`` over the ``k`` checked parameters, ``S_p`` the summed rounding scales of ``p``'s terms, ``r``
    128 machine epsilons (:data:`ROUNDING_RTOL_REDUCED` under reduced precision). :meth:`failures` syncs once.

    Args:
        rtol: the relative tolerance (:data:`VERIFY_RTOL` or :data:`VERIFY_RTOL_REDUCED`).
        reduced: whether the step ran in reduced precision (:func:`reduced_precision`), which sets ``r``.
    """

    def __init__(self, rtol: float, *, reduced: bool = False) -> None:
        self.rtol = rtol
        self.reduced = reduced
        self.params: list[nn.Parameter] = []
        self.diffs: list[torch.Tensor] = []
        self.scales: list[torch.Tensor] = []
        self.rounding: list[torch.Tensor] = []

    def add(self, param: nn.Parameter, terms: list[Term], grad: torch.Tensor | None) -> None:
        """Record one parameter's mismatch (the batch sum of its terms, ``[*param.shape]``) and rounding allowance."""
        ours = batch_sum(terms)
        reference = torch.zeros_like(ours) if grad is None else grad.to(ours.dtype)
        device = self.diffs[0].device if self.diffs else ours.device
        allowance = ROUNDING_RTOL_REDUCED if self.reduced else ROUNDING_EPSILONS * torch.finfo(ours.dtype).eps
        # a tensor: ``terms`` is not empty (one per use of the parameter)
        rounding = cast(torch.Tensor, sum(term.rounding_scales(2).sum().to(device, torch.float32) for term in terms))
        self.params.append(param)
        self.diffs.append((ours - reference).norm().float().to(device))
        self.scales.append(torch.maximum(ours.norm(), reference.norm()).float().to(device))
        self.rounding.append(allowance * rounding)

    def failures(self) -> list[tuple[nn.Parameter, float, float]]:
        """``(param, mismatch, tolerance)`` for each failing parameter (one host sync)."""
        if not self.params:
            return []
        diffs, scales = torch.stack(self.diffs), torch.stack(self.scales)
        floor = scales.square().sum().sqrt() / len(self.params) ** 0.5
        tolerance = self.rtol * (scales + floor) + torch.stack(self.rounding)
        bad = diffs > tolerance
        if not bool(bad.any()):
            return []
        return [
            (param, diff, tol)
            for param, is_bad, diff, tol in zip(
                self.params, bad.tolist(), diffs.tolist(), tolerance.tolist(), strict=True
            )
            if is_bad
        ]


def validate_sum_check(sum_check_every: int | None) -> None:
    """Raise ``ValueError`` unless ``sum_check_every`` is a positive number of batches or ``None`` (no check)."""
    if sum_check_every is not None and sum_check_every < 1:
        raise ValueError(f"sum_check_every must be a positive number of batches or None, got {sum_check_every}")
