"""Privacy accountants: a ledger of events and its (epsilon, delta) guarantee."""

import lightning_dp.accounting.banded_mf  # noqa: F401  (registers "banded-mf")
import lightning_dp.accounting.blt_minsep  # noqa: F401  (registers "blt-minsep")
import lightning_dp.accounting.composition  # noqa: F401  (registers "basic", "advanced")
import lightning_dp.accounting.lap2  # noqa: F401  (registers "lap2", "lap2-paper")
import lightning_dp.accounting.plrv  # noqa: F401  (registers "plrv", "plrv-paper")
import lightning_dp.accounting.rc  # noqa: F401  (registers "rc")
from lightning_dp.accounting import gaussian  # noqa: F401  (registers "rdp", "pld")
from lightning_dp.accounting.base import ACCOUNTANTS, Accountant, make_accountant, register_accountant
from lightning_dp.accounting.calibration_helpers import epsilon_for
from lightning_dp.accounting.composition import advanced_laplace_noise_scale, basic_laplace_noise_scale
from lightning_dp.accounting.events import (
    GaussianEvent,
    PoissonSampledEvent,
    RandomizedClippingGaussianEvent,
    register_event,
)
from lightning_dp.accounting.rc import randomized_clipping_step_event

__all__ = [
    "ACCOUNTANTS",
    "advanced_laplace_noise_scale",
    "basic_laplace_noise_scale",
    "epsilon_for",
    "Accountant",
    "GaussianEvent",
    "PoissonSampledEvent",
    "RandomizedClippingGaussianEvent",
    "make_accountant",
    "randomized_clipping_step_event",
    "register_accountant",
    "register_event",
]
