"""Privacy accountants: a ledger of events and its (epsilon, delta) guarantee."""

from lightning_dp.accounting import gaussian  # noqa: F401  (registers "rdp", "pld")
from lightning_dp.accounting.base import ACCOUNTANTS, Accountant, make_accountant, register_accountant
from lightning_dp.accounting.events import GaussianEvent, PoissonSampledEvent, register_event

# Laplace-family accountants (register "basic", "advanced", "lap2", "lap2-paper", "plrv", "plrv-paper").
from lightning_dp.accounting import composition, lap2, plrv  # noqa: E402, F401, I001
from lightning_dp.accounting.calibration_helpers import epsilon_for  # noqa: E402
from lightning_dp.accounting.composition import (  # noqa: E402
    advanced_laplace_noise_scale,
    basic_laplace_noise_scale,
)

__all__ = [
    "ACCOUNTANTS",
    "advanced_laplace_noise_scale",
    "basic_laplace_noise_scale",
    "epsilon_for",
    "Accountant",
    "GaussianEvent",
    "PoissonSampledEvent",
    "make_accountant",
    "register_accountant",
    "register_event",
]
