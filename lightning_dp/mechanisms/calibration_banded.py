"""Noise calibration of banded matrix factorization under cyclic Poisson sampling (``noise_correlation='banded'``).

The run's epsilon is the ``banded-mf`` accountant's (:mod:`lightning_dp.accounting.banded_mf`), decreasing in the
noise multiplier; :func:`calibrate_banded_mf_noise` finds it with the library's generic monotone root finder
(:func:`~lightning_dp.mechanisms.solver.solve_monotone`). Here, not beside the accountant: the mechanisms import the
accounting package, so the accountant may not import the solver.
"""

from __future__ import annotations

import numpy.typing as npt

from lightning_dp.accounting.banded_mf import band_and_max_column_norm, banded_mf_epsilon
from lightning_dp.accounting.base import validate_delta, validate_epsilon
from lightning_dp.correlated_noise.sensitivity import participation_count
from lightning_dp.correlated_noise.strategies import BandedToeplitz
from lightning_dp.mechanisms.solver import closed_form_noise_ratio, solve_monotone


def calibrate_banded_mf_noise(
    strategy: BandedToeplitz | npt.ArrayLike,
    *,
    steps: int,
    group_sample_rate: float,
    target_epsilon: float,
    target_delta: float,
    num_groups: int | None = None,
) -> tuple[float, float]:
    """The noise multiplier ``sigma`` (noise on ``C x``, clip-norm units) whose epsilon lies in ``[(1 - RTOL) target,
    target]``, through the library's generic root finder
    (:func:`lightning_dp.mechanisms.solver.solve_monotone`, epsilon decreasing in ``sigma``).

    Returns:
        ``(sigma, epsilon)``. Divide ``sigma`` by ``C``'s largest column norm for the ``sigma'`` of the scaling of
        docs/design.md section 5.1 (then it equals DP-SGD's noise multiplier at rate ``q_b`` for ``k`` steps).

    Raises:
        ValueError: the arguments of :meth:`~lightning_dp.accounting.banded_mf.BandedMFAccountant.for_strategy`, a bad
            target, or a target no ``sigma`` reaches.
    """
    validate_epsilon(target_epsilon)
    validate_delta(target_delta)
    band, max_norm = band_and_max_column_norm(strategy, steps)
    k = participation_count(steps, band if num_groups is None else num_groups)
    initial = max_norm * max(closed_form_noise_ratio(target_epsilon, target_delta, group_sample_rate, k), 0.3)

    def epsilon_of(sigma: float) -> float:
        return banded_mf_epsilon(
            strategy,
            steps=steps,
            noise_multiplier=sigma,
            group_sample_rate=group_sample_rate,
            delta=target_delta,
            num_groups=num_groups,
        )

    return solve_monotone(epsilon_of, target_epsilon, initial=initial, increasing=False, bounds=(1e-3, 1e4))
