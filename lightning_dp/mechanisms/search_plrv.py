"""PLRV-O seed, Alg. 1: maximise ``C (k - 1) theta`` subject to constraints c0-c4.

With the closed-form search-space bounds of Appendix D.2 / Corollary D.2; the inner root finding is the shared
:func:`~lightning_dp.mechanisms.solver.solve_monotone`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, cast

import numpy as np
from scipy import optimize, special

from lightning_dp.mechanisms.base import mechanism_class, validate_max_grad_norm
from lightning_dp.mechanisms.solver import (
    _require_num_params,
    _validate_target,
    closed_form_noise_ratio,
    mechanism_epsilon,
    solve_monotone,
)

if TYPE_CHECKING:
    from lightning_dp.mechanisms.plrv import PlrvMechanism


def _plrv(*args: float) -> PlrvMechanism:
    """The ``plrv`` mechanism with these constructor arguments, looked up in the registry (this module is the
    mechanism's search, imported by it: a module-level import of its class would be a cycle)."""
    return cast("PlrvMechanism", mechanism_class("plrv")(*args))


@dataclasses.dataclass(frozen=True)
class PlrvSearch:
    """Result of :func:`search_plrv` (PLRV-O seed, Alg. 1).

    Attributes:
        gamma_shape: ``k*``.
        gamma_scale: ``theta*``.
        max_grad_norm: ``C*``.
        epsilon: achieved epsilon (``<= target``) under ``accountant``.
        accountant: accountant name.
        gamma_cdf: ``GammaCDF(0.1; k*, theta*)`` (constraint c1, must be ``<= gamma_cdf_tol``).
        max_order: the moment order ``lambda_max`` the MGF must exist for (constraint ``(lambda_max+1) C theta < 1``).
        shape_bounds: Corollary D.2's closed-form ``[k_lo, k_hi]`` at ``(C*, theta*, lambda_max)``, or ``None``
            when its per-order intervals do not intersect (diagnostic only, see :func:`corollary_d2_shape_bounds`).
    """

    gamma_shape: float
    gamma_scale: float
    max_grad_norm: float
    epsilon: float
    accountant: str
    gamma_cdf: float
    max_order: int
    shape_bounds: tuple[float, float] | None

    @property
    def distortion(self) -> float:
        """Expected per-coordinate ``E|z| = 1 / ((k - 1) theta)`` (Thm 5.1)."""
        return 1.0 / ((self.gamma_shape - 1.0) * self.gamma_scale)

    @property
    def snr(self) -> float:
        """The objective ``J = C (k - 1) theta`` of Alg. 1."""
        return self.max_grad_norm * (self.gamma_shape - 1.0) * self.gamma_scale

    def mechanism(self) -> PlrvMechanism:
        """The ``plrv`` mechanism with ``(k*, theta*, C*)``."""
        return _plrv(self.gamma_shape, self.gamma_scale, self.max_grad_norm)


def gamma_scale_lower_bound(gamma_shape: float, *, gamma_cdf_tol: float, max_distortion: float) -> float:
    """Smallest ``theta`` allowed by c1 and c4 for shape ``k`` (PLRV-O Appendix D.2, ``max{theta_min(k), 0.1/(k-1)}``).

    - c1: ``GammaCDF(0.1; k, theta) = P(k, 0.1 / theta) <= gamma_cdf_tol``, i.e.
      ``theta >= 0.1 / P^{-1}(k, gamma_cdf_tol)`` (regularised lower incomplete Gamma ``P``).
    - c4: ``E|z| = 1 / ((k - 1) theta) <= max_distortion`` (the paper's ``theta >= 0.1/(k-1)`` for 10).
    """
    c1 = 0.1 / float(special.gammaincinv(gamma_shape, gamma_cdf_tol))
    c4 = 1.0 / (max_distortion * (gamma_shape - 1.0))
    return max(c1, c4)


def corollary_d2_shape_bounds(max_grad_norm: float, gamma_scale: float, max_order: int) -> tuple[float, float] | None:
    """PLRV-O Corollary D.2: the closed-form interval of ``k`` for given ``(C, theta, lambda_max)`` (diagnostic only).

    ``k`` must lie between the roots ``k_{1,2}`` of the corollary for every order ``eta = 2 .. lambda_max + 1``, valid
    for ``theta < 1 / (C (lambda_max + 1))``. The intersection is empty for the paper's own Table 2 configurations, so
    :func:`search_plrv` does not use it as a constraint (docs/design.md section 12.3).

    Returns:
        ``(k_lo, k_hi)``, or ``None`` when the intersection over orders is empty or ``theta`` violates the MGF cap.
    """
    c_theta = max_grad_norm * gamma_scale
    if c_theta * (max_order + 1) >= 1.0:
        return None
    eta = np.arange(2, max_order + 2, dtype=float)
    log_term = np.log1p(-c_theta * (eta - 1.0))
    denom = c_theta**2 * (eta - eta**2)
    disc = 16.0 * log_term**2 + 11.09375 * denom
    if np.any(disc < 0):
        return None
    roots = np.stack(
        [(4.0 * log_term - np.sqrt(disc)) / (2.0 * denom), (4.0 * log_term + np.sqrt(disc)) / (2.0 * denom)]
    )
    lo, hi = float(roots.min(axis=0).max()), float(roots.max(axis=0).min())
    return (lo, hi) if lo <= hi else None


def search_plrv(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    num_params: int | None,
    accountant: str = "plrv",
    *,
    clip_range: tuple[float, float] = (0.1, 1.0),
    gamma_cdf_tol: float = 0.01,
    max_distortion: float = 10.0,
    max_order: int | None = None,
    shape_range: tuple[float, float] = (1.001, 1e6),
) -> PlrvSearch:
    """PLRV-O Alg. 1 (Yang et al. 2025, Sec. 5.1, Appendix D.2): maximise ``J = C (k - 1) theta`` subject to c0-c4.

    - c0: ``C_min <= C <= C_max`` (``clip_range``);
    - c1: ``GammaCDF(0.1; k, theta) <= gamma_cdf_tol``;
    - c2: ``epsilon(k, theta, C) <= target`` under ``accountant``;
    - c3: ``k > 1`` (``shape_range``);
    - c4: ``E|z| = 1 / ((k-1) theta) <= max_distortion``;
    - MGF validity: ``(lambda_max + 1) C theta < 1``; default ``lambda_max = ceil(log(1/delta) / eps)``.

    The result is re-checked with the accountant at ``(k*, theta*, C*)``; for large ``k``, ``J`` is often flat and the
    returned ``k`` one of many equivalent optima. How the search reduces to one dimension: docs/design.md section 12.3.

    Args:
        target_epsilon, target_delta, sample_rate, steps: the privacy target and training schedule.
        num_params: noised coordinates ``n``.
        accountant: ``"plrv"`` (sound, default) or ``"plrv-paper"``.
        clip_range: ``(C_min, C_max)`` of c0; use ``(C, C)`` for a fixed clip.
        gamma_cdf_tol: the c1 tolerance.
        max_distortion: the c4 cap on ``E|z|``.
        max_order: ``lambda_max`` of the MGF constraint.
        shape_range: the ``k`` interval searched (``k > 1``).

    Raises:
        ValueError: invalid arguments, or no feasible point (the message says which constraint binds).
    """
    _validate_target(target_epsilon, target_delta, sample_rate, steps)
    n = _require_num_params("plrv", num_params)
    if not target_delta > 0:
        raise ValueError("search_plrv needs target_delta > 0: the PLRV-O accountants give (epsilon, delta)-DP")
    c_min, c_max = (float(c) for c in clip_range)
    validate_max_grad_norm(c_min)
    if c_max < c_min:
        raise ValueError(f"clip_range must be (C_min, C_max) with C_min <= C_max, got {clip_range}")
    k_lo, k_hi = (float(k) for k in shape_range)
    if not 1.0 < k_lo < k_hi:
        raise ValueError(f"shape_range must satisfy 1 < k_min < k_max (constraint c3), got {shape_range}")
    if max_order is None:
        max_order = math.ceil(math.log(1.0 / target_delta) / target_epsilon)
    phi_cap = (1.0 - 1e-9) / (max_order + 1)  # MGF validity: (lambda_max + 1) C theta < 1

    def epsilon_at(k: float, theta: float, clip: float) -> float:
        return mechanism_epsilon(
            _plrv(k, theta, clip),
            sample_rate=sample_rate,
            steps=steps,
            delta=target_delta,
            num_params=n,
            accountant=accountant,
        )

    # Laplace limit (k -> inf, u -> k theta = 1/b) of the closed-form initialiser: phi0 ~ C / b* = 1 / ratio0
    phi0 = 1.0 / closed_form_noise_ratio(target_epsilon, target_delta, sample_rate, steps)
    phi_cache: dict[float, tuple[float, float]] = {}

    def best_phi(k: float) -> tuple[float, float]:
        """Largest ``phi = C theta`` meeting c2 and the MGF cap at shape ``k``, and its epsilon."""
        if k not in phi_cache:
            if phi_cache:  # warm start: J = (k - 1) phi varies slowly with k, so reuse the nearest shape's J
                near = min(phi_cache, key=lambda kk: abs(math.log((kk - 1.0) / (k - 1.0))))
                initial, growth = (near - 1.0) * phi_cache[near][0] / (k - 1.0), 1.25
            else:
                initial, growth = phi0 / k, 4.0
            theta, eps = solve_monotone(
                lambda th: epsilon_at(k, th, c_max),
                target_epsilon,
                initial=min(initial, phi_cap) / c_max,
                increasing=True,
                bounds=(1e-14, phi_cap / c_max),
                growth=growth,
            )
            phi_cache[k] = (theta * c_max, eps)
        return phi_cache[k]

    def clip_for(k: float, phi: float) -> float | None:
        """Largest ``C`` in ``clip_range`` with ``theta = phi / C`` meeting c1 and c4, or None."""
        theta_min = gamma_scale_lower_bound(k, gamma_cdf_tol=gamma_cdf_tol, max_distortion=max_distortion)
        clip = min(c_max, phi / theta_min)
        return clip if clip >= c_min else None

    def shape_of(log_km1: float) -> float:
        k = 1.0 + math.exp(log_km1)
        for edge in (k_lo, k_hi):  # undo exp(log(.)) rounding at the edges of shape_range
            if math.isclose(k, edge, rel_tol=1e-12):
                return edge
        return min(max(k, k_lo), k_hi)

    feasible: dict[float, tuple[float, float]] = {}  # shape -> (phi, clip) for shapes meeting c0-c4

    def neg_objective(log_km1: float) -> float:
        k = shape_of(log_km1)
        phi, _ = best_phi(k)
        clip = clip_for(k, phi)
        if clip is None:  # c1/c4 fail for every clip: +J, so that any feasible shape beats it
            return (k - 1.0) * phi
        feasible[k] = (phi, clip)
        return -(k - 1.0) * phi

    def infeasible(reason: str) -> ValueError:
        return ValueError(
            f"No PLRV-O configuration in shape_range={shape_range}, clip_range={clip_range} meets c1 "
            f"(GammaCDF(0.1) <= {gamma_cdf_tol}) and c4 (E|z| <= {max_distortion}) at epsilon {target_epsilon}: "
            f"{reason}. Use a smaller clip_range, a larger target epsilon, or relax gamma_cdf_tol / max_distortion."
        )

    # Appendix D.2 closed-form pruning, no accountant call: theta <= phi_cap / C_min, so shapes whose c1/c4 lower
    # bound on theta exceeds that can never be feasible; the bound decreases in k, so they form an interval [1, k_a).
    def slack(log_km1: float) -> float:
        theta_min = gamma_scale_lower_bound(
            shape_of(log_km1), gamma_cdf_tol=gamma_cdf_tol, max_distortion=max_distortion
        )
        return math.log(phi_cap / (c_min * theta_min))

    s_lo, s_hi = math.log(k_lo - 1.0), math.log(k_hi - 1.0)
    if slack(s_hi) < 0:
        raise infeasible("even the MGF cap on C*theta leaves theta below the c1/c4 bound at every shape")
    if slack(s_lo) < 0:
        s_lo = optimize.brentq(slack, s_lo, s_hi, xtol=1e-6)
    grid = np.linspace(s_lo, s_hi, 7)
    values = [neg_objective(float(g)) for g in grid]
    if not feasible:
        raise infeasible("the privacy constraint forces theta too small")
    i = int(np.argmin(values))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    optimize.minimize_scalar(neg_objective, bounds=(float(lo), float(hi)), method="bounded", options={"xatol": 0.1})
    k = max(feasible, key=lambda kk: (kk - 1.0) * feasible[kk][0])  # best of the grid and the refinement
    phi, clip = feasible[k]
    theta = phi / clip
    eps = epsilon_at(k, theta, clip)
    if eps > target_epsilon:
        raise ValueError(
            f"The accountant {accountant!r} is not invariant in C*theta: epsilon {eps:g} at the final point exceeds "
            f"the target {target_epsilon:g}"
        )
    return PlrvSearch(
        gamma_shape=k,
        gamma_scale=theta,
        max_grad_norm=clip,
        epsilon=eps,
        accountant=accountant,
        gamma_cdf=float(special.gammainc(k, 0.1 / theta)),
        max_order=max_order,
        shape_bounds=corollary_d2_shape_bounds(clip, theta, max_order),
    )
