"""Generator-driven noise samplers (Gaussian, Laplace, Gamma), on the device and dtype of a reference tensor.

Imported by mechanisms only in ``sample`` / ``secure_sample``, so the registry and accounting load without torch.
Every draw comes from the ``torch.Generator`` passed in (never the global RNG), which must live on the tensor's
device. 16-bit tensors are sampled in float32 and cast (docs/design.md section 12.3).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from lightning_dp.mechanisms.base import check_positive

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _working_dtype(dtype: torch.dtype) -> torch.dtype:
    if not dtype.is_floating_point:
        raise TypeError(f"noise can only be added to floating-point tensors, got {dtype}")
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def sample_gaussian(like: torch.Tensor, std: float, generator: torch.Generator) -> torch.Tensor:
    """I.i.d. ``N(0, std^2)`` noise shaped like ``like`` (same dtype and device); zeros when ``std`` is 0."""
    noise = torch.empty(like.shape, dtype=_working_dtype(like.dtype), device=like.device)
    noise = noise.normal_(mean=0.0, std=std, generator=generator) if std > 0 else noise.zero_()
    return noise.to(like.dtype)


#: Elements of each piece :func:`add_in_pieces` draws (a multiple of 16, the block of torch's CPU ``normal_``).
PIECE = 1 << 18


def add_in_pieces(grad: torch.Tensor, draw: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``grad += draw(piece)`` over consecutive pieces of a contiguous CPU ``grad`` (any shape), each of :data:`PIECE`
    elements but the last, which has from 16 to ``PIECE + 15``; a smaller ``grad`` is one piece. No noise tensor of
    ``grad``'s size is allocated, whose pages the CPU allocator would fault in afresh at every step.

    ``draw`` must draw every coordinate independently (:attr:`~lightning_dp.mechanisms.base.NoiseMechanism.piecewise`).
    Gaussian pieces (:func:`sample_gaussian`) are the same bits as one draw over ``grad``: torch's CPU ``normal_``
    turns uniforms drawn in order into normals in blocks of 16, redrawing the last 16 when the size is not a multiple
    of 16.
    """
    flat = grad.view(-1)
    start, size = 0, flat.numel()
    while size - start >= PIECE + 16:
        piece = flat[start : start + PIECE]
        piece.add_(draw(piece))
        start += PIECE
    rest = flat[start:]
    rest.add_(draw(rest))


def sample_laplace(like: torch.Tensor, scale: float | torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """I.i.d. ``Lap(0, scale)`` noise shaped like ``like`` (same dtype and device), as ``scale (E1 - E2)``, ``E ~
    Exp(1)``.

    Args:
        like: reference tensor of any shape ``[*]``.
        scale: the Laplace scale ``b > 0`` (density ``exp(-|z|/b) / 2b``), a float or a tensor broadcastable to
            ``like`` (per-coordinate scales, as in PLRV-O).
        generator: the DP generator, on ``like.device``.

    Returns:
        A tensor of shape ``like.shape``; ``E|z| = b``, ``Var z = 2 b^2``.
    """
    work = _working_dtype(like.dtype)
    e1 = torch.empty(like.shape, dtype=work, device=like.device).exponential_(generator=generator)
    e2 = torch.empty_like(e1).exponential_(generator=generator)
    noise = (e1 - e2).mul_(scale)
    return noise.to(like.dtype)


def sample_gamma(
    shape: float,
    scale: float,
    size: torch.Size | tuple[int, ...],
    generator: torch.Generator,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """I.i.d. ``Gamma(shape, scale)`` variables (mean ``shape * scale``) by Marsaglia & Tsang 2000 (ACM TOMS 26(3)),
    vectorised, from generator-driven normals and uniforms.

    Args:
        shape: Gamma shape ``a > 0``.
        scale: Gamma scale ``theta > 0``.
        size: output shape.
        generator: the DP generator, on ``device``.
        dtype: output dtype (floating point; 16-bit types are computed in float32).
        device: output device (defaults to the generator's device).

    Raises:
        ValueError: non-positive or non-finite ``shape`` / ``scale``.
    """
    check_positive("gamma shape", shape)
    check_positive("gamma scale", scale)
    device = generator.device if device is None else torch.device(device)
    work = _working_dtype(dtype)
    boosted = shape < 1.0
    d = (shape + 1.0 if boosted else shape) - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    numel = math.prod(size)

    def propose(count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``count`` Marsaglia-Tsang proposals ``d v`` and their acceptance mask."""
        x = torch.empty(count, dtype=work, device=device).normal_(generator=generator)
        log_u = torch.empty_like(x).uniform_(generator=generator).log_()
        v = (1.0 + c * x) ** 3
        log_v = torch.log(v.clamp_min(torch.finfo(work).tiny))
        return d * v, (v > 0) & (log_u < 0.5 * x * x + d - d * v + d * log_v)

    # first round over everything without index bookkeeping; only the few rejected entries are redrawn
    out, accept = propose(numel)
    pending = torch.nonzero(~accept).reshape(-1)
    while pending.numel() > 0:
        value, accept = propose(pending.numel())
        out[pending[accept]] = value[accept]
        pending = pending[~accept]
    if boosted:
        u = 1.0 - torch.empty_like(out).uniform_(generator=generator)  # in (0, 1]: never a zero draw
        out.mul_(torch.exp(torch.log(u) / shape))
    return out.mul_(scale).reshape(size).to(dtype)


def inverse_gamma_scales(like: torch.Tensor, shape: float, scale: float, generator: torch.Generator) -> torch.Tensor:
    """PLRV-O's per-coordinate Laplace scales ``1/u``, ``u ~ Gamma(shape, scale)`` i.i.d., shaped like ``like``, in
    at least float32 (``1/u`` of a 16-bit ``u`` would be too coarse)."""
    work = _working_dtype(like.dtype)
    return sample_gamma(shape, scale, like.shape, generator, dtype=work, device=like.device).reciprocal_()
