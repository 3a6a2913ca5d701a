"""Noise mechanisms, registered by name (the ``noise=`` argument)."""

from lightning_dp.mechanisms import (  # noqa: F401  (registers the mechanisms by name)
    gaussian,
    lap2,
    laplace,
    laplace_advanced,
    plrv,
)
from lightning_dp.mechanisms.base import MECHANISMS, NoiseMechanism, make_mechanism, register_mechanism
from lightning_dp.mechanisms.calibration import (
    CalibrationResult,
    Lap2Search,
    PlrvSearch,
    calibrate,
    calibrate_result,
    search_lap2,
    search_plrv,
)
from lightning_dp.mechanisms.calibration_rc import calibrate_randomized_clipping, randomized_clipping_epsilon

__all__ = [
    "MECHANISMS",
    "CalibrationResult",
    "Lap2Search",
    "NoiseMechanism",
    "PlrvSearch",
    "calibrate",
    "calibrate_randomized_clipping",
    "calibrate_result",
    "make_mechanism",
    "randomized_clipping_epsilon",
    "register_mechanism",
    "search_lap2",
    "search_plrv",
]
