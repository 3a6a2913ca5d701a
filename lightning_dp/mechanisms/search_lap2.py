"""LAP2 seed, Alg. 1: the largest clipping bound ``C`` with its smallest feasible Laplace scale ``b``.

Started from the closed form of Sec. IV-B, ``b* ~ (2 q / eps) sqrt(T log(1/delta)) C``; one call of the shared root
finder :func:`~lightning_dp.mechanisms.solver.solve_monotone`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, cast

from lightning_dp.mechanisms.base import mechanism_class, validate_max_grad_norm
from lightning_dp.mechanisms.solver import (
    _require_num_params,
    _validate_target,
    closed_form_noise_ratio,
    mechanism_epsilon,
    solve_monotone,
)

if TYPE_CHECKING:
    from lightning_dp.mechanisms.lap2 import Lap2Mechanism


def _lap2(*args: float) -> Lap2Mechanism:
    """The ``lap2`` mechanism with these constructor arguments, looked up in the registry (this module is the
    mechanism's search, imported by it: a module-level import of its class would be a cycle)."""
    return cast("Lap2Mechanism", mechanism_class("lap2")(*args))


@dataclasses.dataclass(frozen=True)
class Lap2Search:
    """Result of :func:`search_lap2` (LAP2 seed, Alg. 1).

    Attributes:
        max_grad_norm: the largest feasible l2 clipping bound ``C*``.
        noise_scale: the smallest feasible Laplace scale ``b*`` at ``C*``.
        epsilon: the achieved epsilon (``<= target``) under ``accountant``.
        accountant: the accountant name.
        initial_noise_scale: the closed-form initialiser ``(2 q / eps) sqrt(T log(1/delta)) C*`` (Sec. IV-B).
    """

    max_grad_norm: float
    noise_scale: float
    epsilon: float
    accountant: str
    initial_noise_scale: float

    @property
    def snr(self) -> float:
        """Per-step signal-to-noise ratio ``C / b`` (Sec. IV-C), the quantity Alg. 1 maximises."""
        return self.max_grad_norm / self.noise_scale

    def mechanism(self) -> Lap2Mechanism:
        """The ``lap2`` mechanism with ``(b*, C*)``."""
        return _lap2(self.noise_scale, self.max_grad_norm)


def search_lap2(
    target_epsilon: float,
    target_delta: float,
    sample_rate: float,
    steps: int,
    num_params: int | None,
    accountant: str = "lap2",
    *,
    max_clip: float = 1.0,
    max_noise_scale: float | None = None,
) -> Lap2Search:
    """LAP2 Alg. 1: the largest ``C <= max_clip`` whose smallest feasible ``b`` is at most ``max_noise_scale``.

    Alg. 1 scans ``C`` upwards and bisects ``b`` for each. Both LAP2 accountants depend on ``(C, b)`` only through
    ``C / b`` (eq. III.8 has ``x_i / b`` with ``x_i`` proportional to ``C``; the sound one uses ``C / sqrt(n)``), so
    the smallest feasible ``b`` is linear in ``C`` and the scan collapses: one root finding for ``b`` at
    ``C = max_clip`` (started at the Sec. IV-B closed form), then, if that ``b`` exceeds ``max_noise_scale``,
    ``C* = max_clip * max_noise_scale / b`` and ``b* = max_noise_scale``. The result is re-checked with the
    accountant at ``(C*, b*)``.

    Args:
        target_epsilon: target epsilon.
        target_delta: target delta in ``(0, 1)``.
        sample_rate: Poisson rate ``q``.
        steps: steps ``T``.
        num_params: noised coordinates ``n`` (any size: the search costs a few dozen accountant calls).
        accountant: ``"lap2"`` (sound, default) or ``"lap2-paper"``.
        max_clip: ``C_max`` of Alg. 1.
        max_noise_scale: ``b_max`` of Alg. 1 (``None``: unbounded, so ``C* = C_max``).

    Raises:
        ValueError: invalid arguments or an unreachable target.
    """
    _validate_target(target_epsilon, target_delta, sample_rate, steps)
    validate_max_grad_norm(max_clip)
    n = _require_num_params("lap2", num_params)

    def epsilon_at(clip: float, scale: float) -> float:
        return mechanism_epsilon(
            _lap2(scale, clip),
            sample_rate=sample_rate,
            steps=steps,
            delta=target_delta,
            num_params=n,
            accountant=accountant,
        )

    ratio0 = closed_form_noise_ratio(target_epsilon, target_delta, sample_rate, steps)
    scale, eps = solve_monotone(
        lambda b: epsilon_at(max_clip, b), target_epsilon, initial=ratio0 * max_clip, increasing=False
    )
    clip = max_clip
    if max_noise_scale is not None and scale > max_noise_scale:
        clip, scale = max_clip * max_noise_scale / scale, float(max_noise_scale)
        eps = epsilon_at(clip, scale)
        if eps > target_epsilon:
            raise ValueError(
                f"The accountant {accountant!r} is not scale-invariant in (C, b): epsilon {eps:g} at the rescaled "
                f"point exceeds the target {target_epsilon:g}"
            )
    return Lap2Search(clip, scale, eps, accountant, ratio0 * clip)
