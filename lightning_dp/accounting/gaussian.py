"""Accountants for the Poisson-subsampled Gaussian mechanism, delegating to Google's ``dp_accounting``.

- ``rdp``: Renyi DP of the sampled Gaussian mechanism (Mironov, Talwar, Zhang 2019), converted to (eps, delta)
  with the improved conversion of Balle et al. 2020 as implemented in ``dp_accounting.rdp``.
- ``pld``: privacy loss distributions (Koskela et al.; Doroshenko et al. 2022), tight up to discretisation;
  the default accountant for Gaussian noise.

Both accept ``GaussianEvent`` and ``PoissonSampledEvent(q, GaussianEvent)``.
"""

from __future__ import annotations

import contextlib
import logging
from abc import abstractmethod
from collections.abc import Iterator
from typing import Any

import dp_accounting
from dp_accounting import pld, rdp

from lightning_dp.accounting.base import Accountant, register_accountant
from lightning_dp.accounting.events import GaussianEvent, PoissonSampledEvent


def to_dp_accounting_event(event: Any) -> dp_accounting.DpEvent:
    """Translate our Gaussian events to ``dp_accounting`` events. Raises ``TypeError`` for others."""
    if isinstance(event, GaussianEvent):
        return dp_accounting.GaussianDpEvent(event.noise_multiplier)
    if isinstance(event, PoissonSampledEvent):
        return dp_accounting.PoissonSampledDpEvent(event.sample_rate, to_dp_accounting_event(event.event))
    raise TypeError(f"{event!r} is not a Gaussian event")


class _RdpConvergenceFilter(logging.Filter):
    """Drops dp-accounting's ``_compute_log_a_frac failed to converge ... Excluding this order`` lines.

    They report that one Renyi order's series did not converge and is left out of the minimum over orders, which
    keeps the epsilon a valid (if slightly looser) upper bound; nothing for the user to act on.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("_compute_log_a_frac failed to converge")


@contextlib.contextmanager
def quiet_rdp_convergence() -> Iterator[None]:
    """Filter :class:`_RdpConvergenceFilter`'s lines from the ``absl`` logger for the duration of the block only.

    absl's ``logging.warning`` also runs ``logging.basicConfig()`` when the root logger has no handler, before any
    filter: the handlers it adds to the root logger during the block are removed again, so that a script which set
    up no logging stays so (and :mod:`lightning_dp.runtime.console` still shows the library's INFO lines).
    """
    absl_logger, quiet = logging.getLogger("absl"), _RdpConvergenceFilter()
    root, before = logging.getLogger(), set(logging.getLogger().handlers)
    absl_logger.addFilter(quiet)
    try:
        yield
    finally:
        absl_logger.removeFilter(quiet)
        if not before:
            for handler in [h for h in root.handlers if h not in before]:
                root.removeHandler(handler)


class _DpAccountingAccountant(Accountant):
    """Shared delegation: rebuild a ``dp_accounting`` accountant from the ledger and query it."""

    def supports(self, event: Any) -> bool:
        if isinstance(event, PoissonSampledEvent):
            return 0.0 <= event.sample_rate <= 1.0 and isinstance(event.event, GaussianEvent)
        return isinstance(event, GaussianEvent)

    @abstractmethod
    def _backend(self) -> dp_accounting.PrivacyAccountant:
        """A fresh, empty ``dp_accounting`` accountant."""

    def _epsilon(self, delta: float) -> float:
        backend = self._backend()
        with quiet_rdp_convergence():
            for event, count in self.ledger:
                if isinstance(event, GaussianEvent) and event.noise_multiplier == 0:
                    return float("inf")
                backend.compose(to_dp_accounting_event(event), count)
            return backend.get_epsilon(delta)


@register_accountant
class RDPAccountant(_DpAccountingAccountant):
    """Renyi-DP accountant (orders 1.25..256 plus large orders), via ``dp_accounting.rdp``."""

    name = "rdp"
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]

    def _backend(self) -> dp_accounting.PrivacyAccountant:
        return rdp.RdpAccountant(orders=self.orders)


@register_accountant
class PLDAccountant(_DpAccountingAccountant):
    """Privacy-loss-distribution accountant (pessimistic discretisation, interval 1e-4), via ``dp_accounting.pld``."""

    name = "pld"
    value_discretization_interval = 1e-4

    def _backend(self) -> dp_accounting.PrivacyAccountant:
        return pld.PLDAccountant(value_discretization_interval=self.value_discretization_interval)
