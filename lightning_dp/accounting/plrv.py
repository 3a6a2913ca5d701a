"""Accountants for Gamma-PLRV noise on an l2-clipped sum (``PlrvEvent``): ``plrv`` (sound) and ``plrv-paper``.

Noise model (Yang et al. 2025, PLRV-O Def. 4.10 / Alg. 3): every coordinate draws its own inverse scale ``u ~
Gamma(k, theta)`` and then ``Lap(0, 1/u)``, independently. One coordinate's moment at clipped value ``x`` is at
most (PLRV-O Thm 4.8 / eq. 20)

    G(x, eta) = eta/(2eta-1) M_u((eta-1)x) + (eta-1)/(2eta-1) M_u(-eta x),    M_u(t) = (1 - t theta)^(-k),

finite only for ``t < 1/theta``: an order with ``lambda C theta >= 1`` is EXCLUDED (MAF ``+inf``, never clipped).

``plrv`` (default, sound; docs/design.md section 6.4): the worst base moment over the l2 ball is bounded by
``exp(n * hhat_eta(C^2/n))``, ``hhat_eta`` a certified concave majorant of ``h_eta(s) = log G(sqrt(s), eta)`` on
``[0, C^2]`` (:func:`plrv_majorant`; construction: docs/accountants.md section 4.3); the add-direction MAF also
bounds the remove direction (docs/accountants.md section 4.5, Lemma 1). ``plrv-paper``: PLRV-O Thm 4.9 (eq. 19) /
Alg. 2, NOT a valid bound for the subsampled mechanism (docs/design.md section 6.3); logs a warning. A mechanism
sharing ONE ``u`` across coordinates (the density of eq. 18) is covered by neither.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

import numpy as np

from lightning_dp.accounting.base import register_accountant
from lightning_dp.accounting.events import PlrvEvent, PoissonSampledEvent
from lightning_dp.accounting.lap2 import PAPER_WARNING
from lightning_dp.accounting.majorization import paper_log_moments
from lightning_dp.accounting.moments import (
    MomentsAccountant,
    expm1_minus_x,
    log1p_minus_x,
    subsampled_log_moments,
    validate_orders,
    validate_positive,
    validate_sample_rate,
)

logger = logging.getLogger("lightning_dp")

#: Absolute slack (per coordinate, nats) added to the majorant to cover floating-point rounding of ``log G``.
_ROUNDING_SLACK = 1e-15


def plrv_log_moment(x: np.ndarray, eta: np.ndarray, k: float, theta: float) -> np.ndarray:
    """``log G(x, eta)`` of PLRV-O eq. 20 for Gamma(k, theta) inverse scales (broadcast ``x`` with ``eta``).

    Computed without cancellation (the linear terms of ``G - 1`` cancel exactly).

    Returns nats; ``+inf`` where ``(eta - 1) theta x >= 1`` (beyond the MGF pole); 0 for ``eta <= 1``.
    """
    x = np.asarray(x, dtype=np.float64)
    eta = np.asarray(eta, dtype=np.float64)
    A = (eta - 1.0) * theta
    B = eta * theta
    m = 2.0 * eta - 1.0
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        ax = np.minimum(A * x, 1.0 - 1e-300)
        r1 = -k * log1p_minus_x(-ax)
        r2 = -k * log1p_minus_x(B * x)
        a1 = k * ax + r1
        a2 = -k * B * x + r2
        b1 = eta / m
        b2 = (eta - 1.0) / m
        small = a1 < 30.0
        gm1 = b1 * (r1 + expm1_minus_x(np.where(small, a1, 0.0))) + b2 * (r2 + expm1_minus_x(a2))
        via_small = np.log1p(gm1)
        via_large = np.logaddexp(np.log(b1) + a1, np.log(b2) + a2)
        out = np.where(small, via_small, via_large)
        out = np.where(A * x >= 1.0, np.inf, out)
    return np.where(eta <= 1.0, 0.0, out)


def _log_slope(x: float, eta: np.ndarray, k: float, theta: float, log_g: np.ndarray) -> np.ndarray:
    """``log h'(s)`` at ``s = x^2``, ``h(s) = log G(sqrt(s))``: ``h' = G'(x) / (2 x G(x))``, shape ``eta``.

    ``G'(x) = c [(1 - A x)^(-k-1) - (1 + B x)^(-k-1)]`` with ``c = k theta eta (eta-1)/(2 eta - 1)``.
    """
    A = (eta - 1.0) * theta
    B = eta * theta
    p1 = -(k + 1.0) * np.log1p(-A * x)
    p2 = -(k + 1.0) * np.log1p(B * x)
    with np.errstate(divide="ignore"):
        log_c = np.log(k * theta) + np.log(eta) + np.log(eta - 1.0) - np.log(2.0 * eta - 1.0)
    return log_c + p1 + np.log(-np.expm1(p2 - p1)) - np.log(2.0 * x) - log_g


def _grid(C: float, n: int, ratio: float) -> np.ndarray:
    """Geometric x-grid ``x* r^j`` on ``[1e-3 x*, C]`` through ``x* = C / sqrt(n)`` and ``C`` (``r <= ratio``)."""
    x_star = C / np.sqrt(n)
    up = int(np.ceil(np.log(C / x_star) / np.log(ratio)))
    r = (C / x_star) ** (1.0 / up) if up > 0 else ratio
    down = int(np.ceil(np.log(1e3) / np.log(r)))
    return x_star * r ** np.arange(-down, up + 1, dtype=np.float64)


def _tent_points(x: np.ndarray, log_g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vertices ``(sigma, v)`` whose concave hull majorises ``h_eta`` on ``[0, x[-1]^2]`` (module docstring).

    Args:
        x: increasing grid ``x_1 < ... < x_P`` (``x_1 > 0``), shape ``(P,)``.
        log_g: ``h_eta(x_j^2) = log G(x_j, eta)``, shape ``(E, P)`` (finite).

    Returns:
        ``sigma`` (shape ``(E, 2P)``) and ``v`` (same shape): the point ``(0, h(x_1^2))`` covering ``[0, x_1^2]``
        (``h`` is increasing), the grid vertices, and for each piece the crossing of its two end tangents (clamped
        to the piece): the tent ``min(T_left, T_right) >= u`` is the polyline through these three vertices.
    """
    s = x * x
    h0, h1 = log_g[:, :-1], log_g[:, 1:]
    dx = np.diff(x)
    dh = h1 - h0
    # u(s) = h_j + mu (sqrt(s) - x_j), mu = chord slope of log G in x; its tangents at both ends of the piece.
    mu = dh / dx
    d_left = mu / (2.0 * x[:-1])
    d_right = mu / (2.0 * x[1:])
    sl, sr = s[:-1], s[1:]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        cross = (h1 - h0 + d_left * sl - d_right * sr) / (d_left - d_right)
    cross = np.where(np.isfinite(cross), np.clip(cross, sl, sr), 0.5 * (sl + sr))
    apex = np.minimum(h0 + d_left * (cross - sl), h1 + d_right * (cross - sr))
    E = log_g.shape[0]
    sigma = np.concatenate([np.zeros((E, 1)), np.broadcast_to(s, log_g.shape), cross], axis=1)
    v = np.concatenate([log_g[:, :1], log_g, apex], axis=1)
    return sigma, v


def _apex_polyline(sigma: np.ndarray, v: np.ndarray, P: int, s_star: float) -> tuple[np.ndarray, np.ndarray]:
    """Fast path: the polyline through the tent crossings and ``(x_P^2, h(x_P^2))``, extended to ``s = 0`` and lifted by
    ``max(0, h(x_1^2) - psi(0))``; a valid ``hhat(s_star)`` where it is certified concave and above every vertex.

    Args:
        sigma, v: tent vertices from :func:`_tent_points`, shape ``(E, 2P)``.
        P: number of grid points.
        s_star: evaluation point ``C^2 / n``.

    Returns:
        ``(value, certified)``, each shape ``(E,)``; rows not certified go to :func:`_best_affine`.
    """
    vert_s, vert_v = sigma[:, 1 : P + 1], v[:, 1 : P + 1]
    poly_s = np.concatenate([sigma[:, P + 1 :], vert_s[:, -1:]], axis=1)
    poly_v = np.concatenate([v[:, P + 1 :], vert_v[:, -1:]], axis=1)
    ds = np.diff(poly_s, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        slopes = np.diff(poly_v, axis=1) / ds
        seg = np.maximum(np.arange(P) - 1, 0)
        line = poly_v[:, seg] + slopes[:, seg] * (vert_s - poly_s[:, seg])
    certified = (
        np.all(ds > 0.0, axis=1)
        & np.all(np.diff(slopes, axis=1) <= 0.0, axis=1)
        & (slopes[:, -1] >= 0.0)
        & np.all(vert_v <= line, axis=1)
    )
    psi0 = poly_v[:, 0] - slopes[:, 0] * poly_s[:, 0]
    d0 = np.maximum(0.0, v[:, 0] - psi0)
    rows = np.arange(sigma.shape[0])
    idx = np.clip(np.sum(poly_s <= s_star, axis=1) - 1, 0, poly_s.shape[1] - 2)
    at_star = poly_v[rows, idx] + slopes[rows, idx] * (s_star - poly_s[rows, idx])
    return at_star + d0, certified


def _best_affine(sigma: np.ndarray, v: np.ndarray, s_star: float) -> np.ndarray:
    """``min_{g >= 0} max_p [v_p + g (s_star - sigma_p)]`` per row (bisection on the slope ``g``), shape ``(E,)``.

    For every ``g >= 0`` the line ``v_p + g (s - sigma_p)`` maximised over ``p`` is an affine majorant of the points
    with non-negative slope, so the value returned for ANY ``g`` is a valid bound; the minimum over ``g`` is the
    concave hull of the points at ``s_star`` (LP duality), reached here to bisection precision.
    """

    def value(g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        lines = v + g[:, None] * (s_star - sigma)
        idx = np.argmax(lines, axis=1)
        rows = np.arange(v.shape[0])
        return lines[rows, idx], s_star - sigma[rows, idx]

    lo = np.zeros(v.shape[0])
    hi = np.maximum((np.max(v, axis=1) - v[:, 0]) / s_star, 0.0) + 1e-300
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        _, grad = value(mid)
        hi = np.where(grad > 0.0, mid, hi)
        lo = np.where(grad > 0.0, lo, mid)
    return np.minimum(value(lo)[0], value(hi)[0])


def plrv_majorant(C: float, n: int, k: float, theta: float, eta_max: int) -> np.ndarray:
    """Certified ``n * hhat_eta(C^2 / n) >= max_{||g||_2 <= C} sum_i log G(|g_i|, eta)`` for ``eta = 0..eta_max``.

    Tent vertices on a geometric grid (ratio 1.05), the certified polyline (:func:`_apex_polyline`) where it applies,
    else a fine grid (ratio 1.01) and the best affine majorant (:func:`_best_affine`); slack ``n * 1e-15``.

    Returns:
        Shape ``(eta_max + 1,)``, nats; ``+inf`` for ``eta`` with ``(eta - 1) C theta >= 1`` (no finite MGF).
    """
    out = np.full(eta_max + 1, np.inf)
    out[: min(2, eta_max + 1)] = 0.0
    valid_max = min(eta_max, int(np.ceil(1.0 / (C * theta))) + 1)
    while valid_max >= 2 and (valid_max - 1) * C * theta >= 1.0:
        valid_max -= 1
    if valid_max < 2:
        return out
    # Exact rows up to eta = 256, then a geometric set (ratio 1.005); eta in between takes the next evaluated value,
    # valid because prod_i G(x_i, eta) is non-decreasing in eta >= 1 (log E[L^t] is convex, 0 at t = 0 and 1).
    eta = np.unique(
        np.concatenate([np.arange(2, min(256, valid_max) + 1), np.round(np.geomspace(256, valid_max, 700))])
    )
    eta = eta[(eta >= 2) & (eta <= valid_max)]
    x = _grid(C, n, 1.05)
    x_star = C / np.sqrt(n)
    s_star = x_star * x_star
    sigma, v = _tent_points(x, plrv_log_moment(x[None, :], eta[:, None], k, theta))
    bound, certified = _apex_polyline(sigma, v, x.shape[0], s_star)
    redo = np.nonzero(~certified)[0]
    if redo.size:
        x_fine = _grid(C, n, 1.01)
        sigma_f, v_f = _tent_points(x_fine, plrv_log_moment(x_fine[None, :], eta[redo, None], k, theta))
        bound[redo] = _best_affine(sigma_f, v_f, s_star)
    bound = bound[np.searchsorted(eta, np.arange(2, valid_max + 1))]
    out[2 : valid_max + 1] = n * (bound + _ROUNDING_SLACK)
    return out


def _plrv_parts(event: Any) -> tuple[float, PlrvEvent]:
    if isinstance(event, PoissonSampledEvent):
        return float(event.sample_rate), event.event
    return 1.0, event


def _validate_plrv(event: PlrvEvent) -> None:
    if not (np.isfinite(event.gamma_shape) and event.gamma_shape > 1.0):
        raise ValueError(
            f"PlrvEvent.gamma_shape (k) must be > 1, got {event.gamma_shape}: for k <= 1 the noise has infinite "
            "expected l1 error (PLRV-O Thm 5.1, constraint c3 of Alg. 1); choose k > 1"
        )
    validate_positive("PlrvEvent.gamma_scale (theta)", event.gamma_scale)
    validate_positive("PlrvEvent.max_grad_norm (l2 clip C)", event.max_grad_norm)
    if int(event.num_params) < 1:
        raise ValueError(f"PlrvEvent.num_params must be a positive integer, got {event.num_params}")


def _supports_plrv(event: Any) -> bool:
    if isinstance(event, PoissonSampledEvent):
        return 0.0 <= event.sample_rate <= 1.0 and isinstance(event.event, PlrvEvent)
    return isinstance(event, PlrvEvent)


@lru_cache(maxsize=256)
def plrv_sound_log_moments(event: Any, orders: tuple[int, ...]) -> np.ndarray:
    """Sound MAF of one ``PlrvEvent`` / ``PoissonSampledEvent(q, PlrvEvent)`` step (module docstring).

    Returns:
        Shape ``(len(orders),)``, nats; ``+inf`` for excluded orders (``lambda C theta >= 1``).

    Raises:
        ValueError: ``k <= 1``, non-positive ``theta``, ``C`` or ``num_params``; ``q`` outside ``[0, 1]``.
    """
    q, base = _plrv_parts(event)
    validate_sample_rate(q)
    _validate_plrv(base)
    ords = validate_orders(np.asarray(orders))
    if q == 0.0:
        return np.zeros(ords.shape[0])
    log_base = plrv_majorant(
        float(base.max_grad_norm),
        int(base.num_params),
        float(base.gamma_shape),
        float(base.gamma_scale),
        int(ords[-1]) + 1,
    )
    if q == 1.0:
        return log_base[ords + 1]
    return subsampled_log_moments(ords, q, log_base)


@lru_cache(maxsize=64)
def plrv_paper_log_moments(event: Any, orders: tuple[int, ...]) -> np.ndarray:
    """PLRV-O Thm 4.9 (eq. 19-20, Alg. 2) MAF of one step via the fast majorization sum; shape ``(len(orders),)``.

    Orders with ``lambda C theta >= 1`` are excluded (``+inf``).
    """
    q, base = _plrv_parts(event)
    validate_sample_rate(q)
    _validate_plrv(base)
    ords = validate_orders(np.asarray(orders))
    k, theta, C = float(base.gamma_shape), float(base.gamma_scale), float(base.max_grad_norm)
    out = np.full(ords.shape[0], np.inf)
    ok = ords * C * theta < 1.0
    if not np.any(ok):
        return out

    def log_moment(x: np.ndarray, eta: np.ndarray) -> np.ndarray:
        return plrv_log_moment(x, eta, k, theta)

    out[ok] = paper_log_moments(C, int(base.num_params), ords[ok], q, log_moment)
    return out


@register_accountant
class PlrvAccountant(MomentsAccountant):
    """Sound accountant for ``PlrvEvent`` and ``PoissonSampledEvent(q, PlrvEvent)`` (default for ``plrv``)."""

    name = "plrv"

    def supports(self, event: Any) -> bool:
        return _supports_plrv(event)

    def event_log_moments(self, event: Any) -> np.ndarray:
        return plrv_sound_log_moments(event, tuple(int(o) for o in validate_orders(self.orders)))


@register_accountant
class PlrvPaperAccountant(MomentsAccountant):
    """PLRV-O paper accountant (Thm 4.9, Alg. 2): reproduces the paper; logs a warning that it is not a valid bound."""

    name = "plrv-paper"
    note = "paper bound (Alg. 2), not valid for the subsampled mechanism"
    plot_label = "plrv-paper (not a valid bound)"

    def __init__(self) -> None:
        super().__init__()
        logger.warning(PAPER_WARNING.format(name=self.name, source="PLRV-O Thm 4.9", sound="plrv"))

    def supports(self, event: Any) -> bool:
        return _supports_plrv(event)

    def event_log_moments(self, event: Any) -> np.ndarray:
        return plrv_paper_log_moments(event, tuple(int(o) for o in validate_orders(self.orders)))
