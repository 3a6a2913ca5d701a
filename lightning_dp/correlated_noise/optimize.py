"""Choosing the strategy ``C``: minimise the workload's error times ``C``'s squared sensitivity.

The objective (Choquette-Choo et al. 2023; McKenna 2024) of a factorisation ``A = B C`` with
``B = A C^{-1}`` and noise ``sigma * sens(C) * Z`` (``Z`` standard normal) is, per coordinate of the model::

    total:  E ||B Z||_F^2 * sens(C)^2 = ||A C^{-1}||_F^2 * sens(C)^2     (the expected total squared error)
    max:    max_t ||(A C^{-1})[t, :]||^2 * sens(C)^2                    (the largest per-step squared error)

both in units of ``sigma^2`` and invariant to scaling ``C``, so ``c_0 = 1`` loses nothing. ``sens`` is the
min-separation sensitivity of :mod:`~lightning_dp.correlated_noise.sensitivity`: exact in both parameterisations
optimised here (banded with ``band <= min_sep``: column norms; BLT constrained to non-negative non-increasing
coefficients). The variables are the Toeplitz coefficients ``c_1..c_{b-1}`` (banded) or the BLT's decays and scales,
optimised by L-BFGS (``scipy.optimize.minimize``) on float64 torch autograd gradients. Results are cached on their
(hashable) inputs.

The objective here ignores amplification: with cyclic Poisson sampling the noise multiplier itself depends on ``b``
(Choquette-Choo et al. 2023, Section 5), which the caller accounts for when choosing ``b``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal

import numpy as np
import scipy.optimize
import torch

from lightning_dp.correlated_noise import sensitivity, toeplitz
from lightning_dp.correlated_noise.strategies import (
    BandedToeplitz,
    BufferedToeplitz,
    Strategy,
    check_band,
    check_buffers,
    sqrt_prefix_coefs,
)
from lightning_dp.correlated_noise.workloads import Workload

ErrorKind = Literal["total", "max"]
_ERRORS = ("total", "max")


def _check_error(error: str) -> ErrorKind:
    if error not in _ERRORS:
        raise ValueError(f"error must be 'total' (expected total squared error) or 'max', got {error!r}")
    return error  # type: ignore[return-value]


def _workload(workload: Workload | None, n: int) -> Workload:
    if workload is None:
        return Workload(n)
    if not isinstance(workload, Workload):
        raise TypeError(f"workload must be a Workload, got {type(workload).__name__}")
    if workload.n != n:
        raise ValueError(f"the workload has n={workload.n} steps but the strategy is for n={n}; build Workload({n})")
    return workload


# --- the objective in torch (float64, differentiable) ------------------------------------------------------------


def _conv(a: torch.Tensor, b: torch.Tensor, m: int) -> torch.Tensor:
    """The first ``m`` terms of the convolution of ``a`` and ``b`` (1-D), by FFT."""
    size = a.numel() + b.numel() - 1
    nfft = 1 << max(size - 1, 0).bit_length()
    out = torch.fft.irfft(torch.fft.rfft(a, nfft) * torch.fft.rfft(b, nfft), nfft)[:m]
    return torch.nn.functional.pad(out, (0, m - out.numel()))


def _inverse_coefs_torch(coefs: torch.Tensor, n: int) -> torch.Tensor:
    """``C^{-1}``'s first ``n`` coefficients from ``C``'s (``c_0 = 1``), by Newton's iteration on power series
    ``g <- g (2 - c g) mod x^m``, ``m`` doubling: ``O(n log n)``, differentiable."""
    g = torch.ones(1, dtype=coefs.dtype)
    m = 1
    while m < n:
        m = min(2 * m, n)
        cg = _conv(coefs[:m], g, m)
        g = _conv(g, torch.cat([2.0 - cg[:1], -cg[1:]]), m)
    return g[:n]


def _error_torch(inv_coefs: torch.Tensor, workload: Workload, error: ErrorKind) -> torch.Tensor:
    """``||A C^{-1}||_F^2`` (``total``) or its largest squared row norm (``max``)."""
    n = workload.n
    if workload.is_toeplitz:
        a = torch.as_tensor(workload.toeplitz_coefs())
        h = _conv(a, inv_coefs, n)  # B = A C^{-1} is Toeplitz; row t's squared norm is sum_{k <= t} h_k^2
        if error == "total":
            return torch.sum(torch.arange(n, 0, -1, dtype=h.dtype) * h**2)
        return torch.sum(h**2)
    m = torch.as_tensor(workload.momentum_coefs())
    rates = torch.as_tensor(workload.learning_rates, dtype=torch.float64)
    h = _conv(m, inv_coefs, n)  # M C^{-1}; B[s + j, s] = sum_{i <= j} eta_{s + i} h_i
    s = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    inside = s + j < n
    index = torch.where(inside, s + j, torch.zeros_like(s + j))
    terms = torch.where(inside, rates[index] * h[j.expand(n, n)], torch.zeros((), dtype=h.dtype))
    entries = torch.cumsum(terms, dim=1) ** 2
    if error == "total":
        return torch.sum(torch.where(inside, entries, torch.zeros((), dtype=h.dtype)))
    rows = torch.zeros(n, dtype=h.dtype).index_add(0, index[inside], entries[inside])
    return torch.max(rows)


def _shifted_sum_torch(coefs: torch.Tensor, min_sep: int, k: int) -> torch.Tensor:
    """Torch version of :func:`~lightning_dp.correlated_noise.sensitivity.shifted_sum` (block cumulative sums)."""
    n = coefs.numel()
    rows = math.ceil(n / min_sep)
    blocks = torch.nn.functional.pad(coefs, (0, rows * min_sep - n)).reshape(rows, min_sep)
    total = torch.cumsum(blocks, dim=0)
    if k < rows:
        total = total - torch.nn.functional.pad(total[: rows - k], (0, 0, k, 0))
    return total.reshape(-1)[:n]


def _loss_torch(coefs: torch.Tensor, workload: Workload, min_sep: int, k: int, error: ErrorKind) -> torch.Tensor:
    """Error times squared sensitivity for coefficients that are either banded with band ``<= min_sep`` or
    non-negative and non-increasing (the two exact cases, where both formulas below agree)."""
    inv = _inverse_coefs_torch(coefs, workload.n)
    sens2 = torch.sum(_shifted_sum_torch(coefs, min_sep, k) ** 2)
    return _error_torch(inv, workload, error) * sens2


def _lbfgs(fun: Callable[[torch.Tensor], torch.Tensor], x0: np.ndarray, max_iterations: int) -> np.ndarray:
    """Minimise ``fun`` (torch, float64) from ``x0`` with scipy's L-BFGS-B."""

    def value_and_grad(x: np.ndarray) -> tuple[float, np.ndarray]:
        params = torch.tensor(x, dtype=torch.float64, requires_grad=True)
        value = fun(params)
        (grad,) = torch.autograd.grad(value, params)
        return float(value.detach()), grad.numpy().astype(np.float64)

    if x0.size == 0:
        return x0
    result = scipy.optimize.minimize(
        value_and_grad, x0, jac=True, method="L-BFGS-B", options={"maxiter": max_iterations, "gtol": 1e-10}
    )
    return np.asarray(result.x, dtype=np.float64)


# --- evaluating a strategy (NumPy) -------------------------------------------------------------------------------


def strategy_error(strategy: Strategy, workload: Workload, error: str = "total") -> float:
    """``||A C^{-1}||_F^2`` (``"total"``) or ``max_t ||(A C^{-1})[t]||^2`` (``"max"``), per unit noise variance.

    Raises:
        ValueError: unknown ``error``.
    """
    kind = _check_error(error)
    inv = torch.as_tensor(strategy.inverse_coefs(workload.n))
    return float(_error_torch(inv, workload, kind))


def strategy_loss(
    strategy: Strategy,
    workload: Workload,
    min_sep: int = 1,
    max_participations: int | None = None,
    error: str = "total",
) -> float:
    """The objective: :func:`strategy_error` times the squared min-separation sensitivity
    (:func:`~lightning_dp.correlated_noise.sensitivity.minsep_sensitivity`, exact or an upper bound as it states).
    DP-SGD (``C = I``) scores ``error(A) * k``.

    Raises:
        ValueError: bad ``min_sep``, ``max_participations`` or ``error``.
    """
    n = workload.n
    sens = sensitivity.minsep_sensitivity(strategy.toeplitz_coefs(n), n, min_sep, max_participations)
    return strategy_error(strategy, workload, error) * sens**2


# --- banded ------------------------------------------------------------------------------------------------------


def optimize_banded(
    n: int,
    band: int,
    *,
    min_sep: int | None = None,
    max_participations: int | None = None,
    workload: Workload | None = None,
    error: str = "total",
    max_iterations: int = 500,
) -> BandedToeplitz:
    """The ``band``-banded Toeplitz strategy (``c_0 = 1``) minimising :func:`strategy_loss` for ``workload``.

    Starts from the first ``band`` coefficients of ``A^{1/2}`` for prefix sums (:func:`sqrt_prefix_coefs`) and
    runs L-BFGS over ``c_1..c_{band-1}`` (McKenna 2024: banded Toeplitz strategies, optimised on their
    coefficients). ``band = 1`` returns ``C = I`` (DP-SGD) without optimising. Cached on the arguments.

    Args:
        n: steps, ``>= 1``.
        band: ``b`` in ``[1, n]``.
        min_sep: the participation's minimum separation, ``>= band`` (``None``: ``band``, as cyclic Poisson sampling
            over ``band`` groups gives).
        max_participations: ``k`` (``None``: ``ceil(n / min_sep)``). Pass 1 for the amplified accounting of cyclic
            Poisson sampling, whose noise is scaled by the largest column norm (docs/design.md section 5.1).
        workload: the :class:`Workload` (``None``: prefix sums over ``n`` steps).
        error: ``"total"`` (expected total squared error) or ``"max"``.
        max_iterations: L-BFGS iterations at most.

    Raises:
        ValueError: ``band`` outside ``[1, n]``, ``min_sep < band`` (the column-norm sensitivity needs
            ``band <= min_sep``), a workload of another ``n``, or a bad ``error``.
    """
    n = toeplitz.check_size(n)
    band = check_band(band, n)
    sep = band if min_sep is None else sensitivity.check_min_sep(min_sep)
    if sep < band:
        raise ValueError(
            f"min_sep={sep} < band={band}: a banded strategy's sensitivity from its column norms needs band <= min_sep;"
            " lower the band or separate participations more"
        )
    k = sensitivity.participation_count(n, sep, max_participations)
    return _optimize_banded(n, band, sep, k, _workload(workload, n), _check_error(error), int(max_iterations))


@functools.lru_cache(maxsize=64)
def _optimize_banded(
    n: int, band: int, min_sep: int, k: int, workload: Workload, error: ErrorKind, max_iterations: int
) -> BandedToeplitz:
    if band == 1:
        return BandedToeplitz.identity()
    identity_loss = float(_loss_torch(torch.ones(1, dtype=torch.float64), workload, min_sep, k, error))

    def loss(tail: torch.Tensor) -> torch.Tensor:
        coefs = torch.cat([torch.ones(1, dtype=torch.float64), tail])
        return _loss_torch(coefs, workload, min_sep, k, error) / identity_loss

    start = sqrt_prefix_coefs(band)[1:]
    tail = _lbfgs(loss, start, max_iterations)
    best = tail if float(loss(torch.as_tensor(tail))) <= float(loss(torch.as_tensor(start))) else start
    return BandedToeplitz((1.0, *best.tolist()))


# --- buffered linear Toeplitz ------------------------------------------------------------------------------------


def _blt_from_raw(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unconstrained ``[2d]`` -> (decays in (0, 1), scales > 0 with sum < 1): the BLT's coefficients are then
    positive and non-increasing, the case where its min-separation sensitivity is exact."""
    d = raw.numel() // 2
    decays = torch.sigmoid(raw[:d])
    weights = torch.exp(raw[d:])
    scales = weights / (1.0 + weights.sum())
    return decays, scales


def _blt_coefs_torch(decays: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    powers = torch.arange(n - 1, dtype=torch.float64)[:, None]
    tail = (scales * decays**powers).sum(dim=1)
    return torch.cat([torch.ones(1, dtype=torch.float64), tail])


def _blt_starts(n: int, buffers: int) -> list[np.ndarray]:
    """A few starting points: decays spread geometrically towards 1 (time scales ``n^(j / (d + 1))``), total scale
    0.3, 0.6 or 0.9 spread evenly."""
    starts = []
    times = n ** (np.arange(1, buffers + 1) / (buffers + 1))
    decays = np.clip(1.0 - 1.0 / times, 1e-3, 1 - 1e-6)
    for total in (0.3, 0.6, 0.9):
        scales = np.full(buffers, total / buffers)
        weights = scales / (1.0 - scales.sum())
        starts.append(np.concatenate([np.log(decays / (1 - decays)), np.log(weights)]))
    return starts


def optimize_blt(
    n: int,
    buffers: int,
    *,
    min_sep: int = 1,
    max_participations: int | None = None,
    workload: Workload | None = None,
    error: str = "total",
    max_iterations: int = 500,
) -> BufferedToeplitz:
    """The BLT strategy with ``buffers`` buffers minimising :func:`strategy_loss` for ``workload``.

    Variables: decays ``theta_j = sigmoid(u_j)`` in (0, 1) and scales ``w_j = exp(v_j) / (1 + sum exp(v))`` (positive,
    sum below 1), so the coefficients stay positive and non-increasing and the min-separation sensitivity used is
    exact (Kalinin and Lampert 2024, Theorem 2; McMahan et al. 2024 extend BLTs to multiple participations).
    L-BFGS from a few starts; the best is returned. Cached on the arguments.

    Args:
        n: steps, ``>= 1``.
        buffers: ``d >= 1``.
        min_sep: the participation's minimum separation (1: any steps).
        max_participations: ``k`` (``None``: ``ceil(n / min_sep)``).
        workload: the :class:`Workload` (``None``: prefix sums).
        error: ``"total"`` or ``"max"``.
        max_iterations: L-BFGS iterations at most, per start.

    Raises:
        ValueError: ``buffers < 1``, bad ``min_sep`` / ``max_participations``, a workload of another ``n``, a bad
            ``error``.
    """
    n = toeplitz.check_size(n)
    buffers = check_buffers(buffers)
    sep = sensitivity.check_min_sep(min_sep)
    k = sensitivity.participation_count(n, sep, max_participations)
    return _optimize_blt(n, buffers, sep, k, _workload(workload, n), _check_error(error), int(max_iterations))


@functools.lru_cache(maxsize=64)
def _optimize_blt(
    n: int, buffers: int, min_sep: int, k: int, workload: Workload, error: ErrorKind, max_iterations: int
) -> BufferedToeplitz:
    identity_loss = float(_loss_torch(torch.ones(1, dtype=torch.float64), workload, min_sep, k, error))

    def loss(raw: torch.Tensor) -> torch.Tensor:
        decays, scales = _blt_from_raw(raw)
        return _loss_torch(_blt_coefs_torch(decays, scales, n), workload, min_sep, k, error) / identity_loss

    best, best_loss = None, math.inf
    for start in _blt_starts(n, buffers):
        raw = _lbfgs(loss, start, max_iterations)
        value = float(loss(torch.as_tensor(raw)))
        if math.isfinite(value) and value < best_loss:
            best, best_loss = raw, value
    if best is None:
        raise RuntimeError(f"BLT optimisation found no finite objective for n={n}, buffers={buffers}")
    decays, scales = _blt_from_raw(torch.as_tensor(best))
    return BufferedToeplitz(tuple(decays.tolist()), tuple(scales.tolist()))
