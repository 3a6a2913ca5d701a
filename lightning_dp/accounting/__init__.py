"""Privacy accountants: a ledger of events and its (epsilon, delta) guarantee."""

from lightning_dp.accounting import gaussian  # noqa: F401  (registers "rdp", "pld")
from lightning_dp.accounting.base import ACCOUNTANTS, Accountant, make_accountant, register_accountant
from lightning_dp.accounting.events import GaussianEvent, PoissonSampledEvent, register_event

__all__ = [
    "ACCOUNTANTS",
    "Accountant",
    "GaussianEvent",
    "PoissonSampledEvent",
    "make_accountant",
    "register_accountant",
    "register_event",
]
