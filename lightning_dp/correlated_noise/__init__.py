"""Correlated noise across steps: the matrix-factorization mechanism's strategies, sensitivity and streaming noise.

The noise added to step ``t``'s clipped gradient sum is ``sigma * clip_norm * sens(C) * (C^{-1} Z)_t`` for a
lower-triangular Toeplitz strategy ``C`` (Denisov et al. 2022; Choquette-Choo et al. 2023; Dvijotham et al. 2024).
Modules, each with one job:

- :mod:`~lightning_dp.correlated_noise.toeplitz`: lower-triangular Toeplitz algebra on coefficient vectors (NumPy).
- :mod:`~lightning_dp.correlated_noise.strategies`: :class:`BandedToeplitz` and :class:`BufferedToeplitz` (BLT).
- :mod:`~lightning_dp.correlated_noise.sensitivity`: min-separation sensitivity, exact or a stated upper bound.
- :mod:`~lightning_dp.correlated_noise.workloads`: :class:`Workload` (prefix sums, momentum, learning rates).
- :mod:`~lightning_dp.correlated_noise.optimize`: :func:`optimize_banded`, :func:`optimize_blt` (torch, scipy).
- :mod:`~lightning_dp.correlated_noise.streaming`: :func:`noise_stream`, the streaming ``C^{-1} Z`` (torch).

Names are imported on first use, so the NumPy-only modules load without torch or scipy. The training option built on
them is ``noise_correlation='banded'`` or ``'blt'`` (:mod:`lightning_dp.engine.correlation`: amplified banded MF
under cyclic Poisson sampling, the noise scaled by the largest column norm instead of ``sens(C)``; BLT under
``floor(1 / q)``-min-separated cyclic sampling, accounted by ``sens(C)`` without amplification); docs/design.md
section 5.1 says what each part provides for the privacy argument.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_dp.correlated_noise.optimize import optimize_banded, optimize_blt, strategy_error, strategy_loss
    from lightning_dp.correlated_noise.sensitivity import (
        dense_minsep_sensitivity_upper_bound,
        minsep_sensitivity,
        minsep_sensitivity_is_exact,
        participation_count,
    )
    from lightning_dp.correlated_noise.strategies import BandedToeplitz, BufferedToeplitz, Strategy
    from lightning_dp.correlated_noise.streaming import BandedNoise, BLTNoise, CorrelatedNoise, noise_stream
    from lightning_dp.correlated_noise.workloads import Workload

__all__ = [
    "BLTNoise",
    "BandedNoise",
    "BandedToeplitz",
    "BufferedToeplitz",
    "CorrelatedNoise",
    "Strategy",
    "Workload",
    "dense_minsep_sensitivity_upper_bound",
    "minsep_sensitivity",
    "minsep_sensitivity_is_exact",
    "noise_stream",
    "optimize_banded",
    "optimize_blt",
    "participation_count",
    "strategy_error",
    "strategy_loss",
]

#: Public name -> the submodule it is imported from on first use.
_EXPORTS: dict[str, str] = {
    "BandedToeplitz": "strategies",
    "BufferedToeplitz": "strategies",
    "Strategy": "strategies",
    "Workload": "workloads",
    "minsep_sensitivity": "sensitivity",
    "minsep_sensitivity_is_exact": "sensitivity",
    "dense_minsep_sensitivity_upper_bound": "sensitivity",
    "participation_count": "sensitivity",
    "optimize_banded": "optimize",
    "optimize_blt": "optimize",
    "strategy_error": "optimize",
    "strategy_loss": "optimize",
    "CorrelatedNoise": "streaming",
    "BandedNoise": "streaming",
    "BLTNoise": "streaming",
    "noise_stream": "streaming",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
