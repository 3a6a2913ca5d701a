"""Noise samplers of ``secure_mode``: mitigations of floating-point attacks on textbook samplers (Mironov 2012, CCS;
Jin et al. 2022, arXiv:2112.05307).

Holohan & Braghin (2021), "Secure random sampling in differential privacy" (ESORICS, arXiv:2107.10138), Section 5:
each sample is built from several independent draws, with exactly the law the accountants assume:

- Gaussian ``N(0, s^2)``: ``(X_1 + X_2 + X_3 + X_4) / 2``, ``X_k ~ N(0, s^2)`` (as Opacus's ``secure_mode``);
- Laplace ``Lap(0, b)``: ``b (log(U_1) cos(pi U_2) + log(U_3) cos(pi U_4))``, ``U_k ~ U(0, 1]`` (as diffprivlib);
- PLRV-O: the Gamma inverse scale as usual, then the Laplace sampler above.

A mitigation, not a proof: what is and is not covered, and why the snapping mechanism is not implemented:
docs/privacy.md and docs/design.md section 12.3.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from lightning_dp.mechanisms.base import (
    MECHANISMS,
    NoiseMechanism,
    secure_mechanisms,
    secure_mode_unsupported,
)
from lightning_dp.mechanisms.sampling import _working_dtype

#: number of Gaussian draws summed per sample (2n with n = 2, as Opacus).
GAUSSIAN_DRAWS = 4


def __getattr__(name: str) -> Any:
    """``SECURE_MECHANISMS``: the registered mechanisms with ``supports_secure``, read at access time."""
    if name == "SECURE_MECHANISMS":
        return secure_mechanisms()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def secure_gaussian(like: torch.Tensor, std: float, generator: torch.Generator) -> torch.Tensor:
    """``N(0, std^2)`` noise shaped like ``like`` as the sum of 4 draws divided by 2 (Holohan & Braghin 2021,
    Section 5.1; Opacus ``_generate_noise``). Computed in at least float32, returned in ``like.dtype``."""
    work = _working_dtype(like.dtype)
    total = torch.zeros(like.shape, dtype=work, device=like.device)
    if std == 0:
        return total.to(like.dtype)
    for _ in range(GAUSSIAN_DRAWS):
        total.add_(torch.empty_like(total).normal_(mean=0.0, std=std, generator=generator))
    return total.div_(math.sqrt(GAUSSIAN_DRAWS)).to(like.dtype)


def _unit_interval(template: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``U(0, 1]`` (never 0, so its logarithm is finite)."""
    return 1.0 - torch.empty_like(template).uniform_(generator=generator)


def secure_laplace(like: torch.Tensor, scale: float | torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """``Lap(0, scale)`` noise shaped like ``like`` from four uniforms per sample (module docstring).

    Args:
        like: reference tensor ``[*]`` (floating point).
        scale: Laplace scale ``b > 0``, a float or a tensor broadcastable to ``like`` (PLRV-O).
        generator: the noise generator, on ``like.device``.

    Returns:
        ``like.shape``, ``like.dtype``; ``E|z| = b``, ``Var z = 2 b^2``.
    """
    work = _working_dtype(like.dtype)
    template = torch.empty(like.shape, dtype=work, device=like.device)
    u = [_unit_interval(template, generator) for _ in range(4)]
    noise = u[0].log_().mul_(torch.cos(math.pi * u[1])).add_(u[2].log_().mul_(torch.cos(math.pi * u[3])))
    return noise.mul_(scale).to(like.dtype)


def check_secure_mechanism(mechanism: NoiseMechanism | str) -> None:
    """Raise ``ValueError`` unless ``secure_mode`` has a sampler for ``mechanism`` (an instance or a name): its class
    says so with ``supports_secure``."""
    if isinstance(mechanism, str):
        name, cls = mechanism, MECHANISMS.get(mechanism, None)
    else:
        name, cls = mechanism.name, type(mechanism)
    if cls is None or not cls.supports_secure:
        raise ValueError(secure_mode_unsupported(name))


def secure_sample(mechanism: NoiseMechanism, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The noise of ``mechanism`` (same law as ``mechanism.sample``) drawn with the samplers of this module
    (``mechanism.secure_sample``).

    Raises:
        ValueError: a mechanism without a secure sampler (see :func:`check_secure_mechanism`).
    """
    check_secure_mechanism(mechanism)
    return mechanism.secure_sample(like, generator)
