"""Envelope CDF of the randomized-clipping scale ``Y`` (Ullah et al. 2026, DP-SGD-RC: Thm 5.1, Prop. 5.2, B.1, B.6,
B.8, B.24; Algorithms 3 and 4).

With Hutchinson's estimator on ``k`` projection columns the estimated squared norm is ``||g||^2 X(lambda)``,
``X(lambda) = sum_i lambda_i X_i``, ``X_i ~ chi^2(k) / k`` i.i.d., ``lambda`` in the simplex of dimension ``d - 1``
(Sec. 5.1). The accountant needs a data-independent ``Y`` with ``F(x; Y) >= sup_lambda F(x; X(lambda))`` for every
``x`` (Lemma A.5 / B.3: sensitivity scale ``a = 1 / sqrt(Y)``). :func:`envelope_cdf_bound`, the bound ``rc`` uses,
is ``F(x; chi^2(k)/k)`` below 1 and ``1`` from 1 on (Prop. B.24), an upper bound on the envelope for every ``d``.
:func:`vertex_cdf`, :func:`uniform_cdf`, :func:`two_point_cdf`, :func:`middle_region_sup`, :func:`x_plus` and
:func:`vertex_uniform_crossing` reproduce the paper's brute-force branches for small ``d``. Why not the paper's ``x_+
= 1 + 2/(dk)``, and the corrections to Thm 5.1 and Algorithm 3: docs/accountants.md sections 2 (``rc``), 3 and 4.6.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import numpy as np
from scipy import optimize, special

Estimator = Literal["hutch", "hutchpp"]
ESTIMATORS: tuple[str, ...] = ("hutch", "hutchpp")


@functools.cache
def _gauss_legendre() -> tuple[np.ndarray, np.ndarray]:
    """Nodes and weights of the 256-point Gauss-Legendre rule of :func:`two_point_cdf` (integration in probability
    space, smooth integrand), computed on first use: about half a second, which an import should not cost."""
    return np.polynomial.legendre.leggauss(256)


def validate_rc(projection_dim: int, norm_dim: int, estimator: str) -> None:
    """Raise ``ValueError`` unless ``k >= 1``, ``d >= 1`` are integers and ``estimator`` is hutch / hutchpp."""
    if int(projection_dim) != projection_dim or projection_dim < 1:
        raise ValueError(f"projection_dim k must be a positive integer (e.g. 32), got {projection_dim}")
    if int(norm_dim) != norm_dim or norm_dim < 1:
        raise ValueError(f"norm_dim d must be a positive integer (the widest layer's min(p, d)), got {norm_dim}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")


def _chi2_mean_cdf(x: np.ndarray | float, dof: float) -> np.ndarray:
    """``F(x; chi^2(dof) / dof)`` (mean-one chi-squared), vectorised; 0 for ``x <= 0``."""
    x = np.asarray(x, dtype=float)
    return special.gammainc(dof / 2.0, np.maximum(x, 0.0) * dof / 2.0)


def vertex_cdf(x: np.ndarray | float, k: int) -> np.ndarray:
    """``F(x; chi^2(k)/k)``: the vertex ``lambda = e`` (all weight on one eigenvalue). Shape of ``x``."""
    return _chi2_mean_cdf(x, k)


def uniform_cdf(x: np.ndarray | float, k: int, d: int) -> np.ndarray:
    """``F(x; chi^2(kd)/(kd))``: the centre ``lambda = u`` (equal eigenvalues). Shape of ``x``."""
    return _chi2_mean_cdf(x, k * d)


def two_point_cdf(x: float, k: int, i: int, j: int, lam: np.ndarray | float) -> np.ndarray:
    """``F(x; lam chi^2(ik)/(ik) + (1 - lam) chi^2(jk)/(jk))`` (Prop. 5.2 / B.1), vectorised over ``lam``.

    Integrated by 256-point Gauss-Legendre after conditioning on ``chi^2(ik)`` (absolute error below 1e-6 at ``k =
    32``).

    Args:
        x: point (> 0).
        k: projection columns; ``i, j``: multiplicities of the two weights (``i >= 1``, ``j >= 0``).
        lam: weight of the first group, in ``[0, 1]`` (array of shape ``[n]`` or scalar).
    """
    lam = np.atleast_1d(np.asarray(lam, dtype=float))
    out = np.empty_like(lam)
    a_dof, b_dof = i * k, j * k
    nodes, weights = _gauss_legendre()
    for n, lm in enumerate(lam):
        if j == 0 or lm >= 1.0:
            out[n] = _chi2_mean_cdf(x, a_dof) if lm > 0 else 1.0
            continue
        if lm <= 0.0:
            out[n] = _chi2_mean_cdf(x, b_dof)
            continue
        p_max = float(special.gammainc(a_dof / 2.0, x * a_dof / (2.0 * lm)))
        p = 0.5 * p_max * (nodes + 1.0)
        u = special.gammaincinv(a_dof / 2.0, p) * 2.0 / a_dof  # chi^2(ik)/(ik) at probability p
        rest = (x - lm * u) / (1.0 - lm)
        out[n] = 0.5 * p_max * float(np.dot(weights, _chi2_mean_cdf(rest, b_dof)))
    return out


def middle_region_sup(x: float, k: int, d: int, n_lambda: int = 101) -> tuple[float, int, int, float]:
    """Algorithm 4's MIDDLEREGIONCDF: ``max F(x; S(i, j, lam))`` over ``1 <= i + j <= d`` and a ``lam`` grid.

    A brute-force lower estimate of the envelope, ``O(d^2 n_lambda)`` quadratures: small ``d`` only.

    Returns:
        ``(F, i, j, lam)`` at the best point found (``j = 0`` means the single group ``chi^2(ik)/(ik)``).
    """
    best = (-1.0, 1, 0, 1.0)
    grid = np.linspace(0.0, 1.0, n_lambda)
    for i in range(1, d + 1):
        single = float(_chi2_mean_cdf(x, i * k))
        if single > best[0]:
            best = (single, i, 0, 1.0)
        for j in range(1, d - i + 1):
            values = two_point_cdf(x, k, i, j, grid)
            n = int(np.argmax(values))
            if values[n] > best[0]:
                best = (float(values[n]), i, j, float(grid[n]))
    f, i, j, lam = best
    if j > 0:
        step = 1.0 / (n_lambda - 1)
        res = optimize.minimize_scalar(
            lambda t: -float(two_point_cdf(x, k, i, j, t)[0]),
            bounds=(max(lam - step, 0.0), min(lam + step, 1.0)),
            method="bounded",
            options={"xatol": 1e-6},
        )
        if -res.fun > f:
            f, lam = float(-res.fun), float(res.x)
    return f, i, j, lam


def x_plus(k: int, d: int, tol: float = 1e-4, n_lambda: int = 41) -> float:
    """``x_+`` of Prop. 5.2 by bisection on ``[1, 2]`` (Algorithm 3 with the corrected test, Thm B.4; small ``d`` only).

    Returns:
        The upper end of the final bracket (width ``<= tol``).
    """
    lo, hi = 1.0, 2.0
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if middle_region_sup(mid, k, d, n_lambda)[0] > float(uniform_cdf(mid, k, d)) + 1e-5:
            lo = mid
        else:
            hi = mid
    return hi


def vertex_uniform_crossing(k: int, d: int) -> float:
    """The ``x > 1`` where ``F(x; X(u))`` overtakes ``F(x; X(e))`` (scipy ``brentq``): a lower bound on ``x_+``.

    Above 1 the uniform CDF rises faster; at this point both are envelope candidates, so the envelope equals the
    uniform CDF only from here on or later. Returns 1.0 for ``d = 1`` (vertex and uniform coincide).
    """
    if d == 1:
        return 1.0
    gap = lambda x: float(uniform_cdf(x, k, d) - vertex_cdf(x, k))  # noqa: E731
    return float(optimize.brentq(gap, 1.0 + 1e-12, 3.0, xtol=1e-12, rtol=1e-12))


def envelope_cdf_bound(x: np.ndarray | float, k: int) -> np.ndarray:
    """``F(x; Y)`` for the scale variable the ``rc`` accountant uses: ``Y = min(chi^2(k)/k, 1)``.

    Exactly the Hutch++ envelope (seed Prop. B.24: ``F(x; chi^2(k)/k)`` for ``x < 1``, 1 for ``x >= 1``) and an
    upper bound on the Hutch envelope of Thm 5.1 for every ``d`` (see the module docstring). Shape of ``x``.
    """
    x = np.asarray(x, dtype=float)
    return np.where(x >= 1.0, 1.0, vertex_cdf(x, k))


def scale_atoms(
    k: int,
    *,
    fine_ratio: float = 1.004,
    coarse_ratio: float = 1.05,
    coarse_mass: float = 1e-6,
    tail_mass: float = 1e-14,
    max_scale: float = 1e3,
    max_cells: int = 600,
) -> tuple[np.ndarray, np.ndarray, float]:
    """Pessimistic discretisation of the sensitivity scale ``a = 1 / sqrt(Y)``, ``Y = min(chi^2(k)/k, 1)``.

    Each cell's mass is put at its largest ``a``, the atom ``P(Y = 1)`` at ``a = 1`` and the lower tail at ``a = inf``,
    so the discrete scale dominates the true one (valid for the accountant, Lemma A.5 / B.3; construction and error:
    docs/accountants.md section 4.6).

    Returns:
        ``(scales [M+1], weights [M+1], infinite_mass)``: finite scales ``a >= 1`` with their probabilities, and
        the probability of ``a = inf``; everything sums to 1.
    """
    quantile = lambda p: float(special.gammaincinv(k / 2.0, p)) * 2.0 / k  # noqa: E731
    y0 = min(max(quantile(tail_mass), max_scale**-2), 0.5)
    y_mid = min(max(quantile(coarse_mass), y0), 1.0)
    coarse = np.geomspace(y0, y_mid, max(2, math.ceil(math.log(y_mid / y0) / math.log(coarse_ratio)) + 1))
    fine = np.geomspace(y_mid, 1.0, min(max_cells, max(2, math.ceil(math.log(1.0 / y_mid) / math.log(fine_ratio)) + 1)))
    cuts = np.concatenate([coarse[:-1], fine])
    cdf = vertex_cdf(cuts, k)
    weights = np.append(np.diff(cdf), 1.0 - cdf[-1])
    scales = 1.0 / np.sqrt(cuts)
    return scales, weights, float(cdf[0])


__all__ = [
    "ESTIMATORS",
    "Estimator",
    "envelope_cdf_bound",
    "middle_region_sup",
    "scale_atoms",
    "two_point_cdf",
    "uniform_cdf",
    "validate_rc",
    "vertex_cdf",
    "vertex_uniform_crossing",
    "x_plus",
]
