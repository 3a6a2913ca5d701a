"""Noise samplers of ``secure_mode``: mitigations of floating-point attacks on textbook samplers.

Mironov (2012), "On significance of the least significant bits for differential privacy" (CCS), shows that the
textbook Laplace sampler ``-b sign(u) log(1 - 2|u|)`` in floating point cannot produce every float near the true
value, and which floats it can produce depends on the true value, so the released ``f(D) + noise`` can identify
``D``. Jin et al. (2022, arXiv:2112.05307) give the corresponding attack on Gaussian samplers, Opacus included.

The mitigation used here is that of Holohan & Braghin (2021), "Secure random sampling in differential privacy"
(ESORICS 2021, arXiv:2107.10138), Section 5: build each sample from several independent draws so that a given output
float has astronomically many preimages, which makes the attacker's search over the generator's outputs
infeasible (for a sum of ``2n`` draws the search grows as ``2^(p(2n-1))`` with ``p = 53`` mantissa bits):

- Gaussian ``N(0, s^2)``: ``(X_1 + X_2 + X_3 + X_4) / 2`` with ``X_k ~ N(0, s^2)`` i.i.d. (``n = 2``), as Opacus's
  ``_generate_noise(secure_mode=True)``; the sum has exactly the law ``N(0, s^2)``.
- Laplace ``Lap(0, b)``: ``b (log(U_1) cos(pi U_2) + log(U_3) cos(pi U_4))`` with ``U_k ~ U(0, 1]`` i.i.d. (the
  sampler of Holohan & Braghin, also diffprivlib's). Exact law: ``-log U ~ Exp(1)`` and ``cos(pi U)`` has the arcsine
  law, and ``E[exp(i t E cos(pi U))] = (1/pi) int_0^pi d(phi) / (1 - i t cos phi) = (1 + t^2)^(-1/2)``, so the sum
  of two independent terms has characteristic function ``1 / (1 + t^2)``, that of ``Lap(0, 1)``.
- PLRV-O: the Gamma-distributed inverse scale as usual, then the Laplace sampler above.

Each mechanism draws its own hardened noise (``NoiseMechanism.secure_sample``, with ``supports_secure = True``) from
the primitive samplers here; :func:`secure_sample` and :func:`check_secure_mechanism` read the mechanism class.

Both samplers have, in exact arithmetic, the law the accountants assume, so the accounting is unchanged. They are a
mitigation, not a proof: see docs/privacy.md for what is and is not covered (the snapping mechanism of Mironov 2012,
which does come with a floating-point proof, is NOT implemented, because it changes the output distribution
(rounding to a grid, clamping) and the accountants here do not account for it).
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
