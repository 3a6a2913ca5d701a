"""Noise mechanisms, registered by name (the ``noise=`` argument)."""

from lightning_dp.mechanisms import gaussian  # noqa: F401  (registers "gaussian")
from lightning_dp.mechanisms.base import MECHANISMS, NoiseMechanism, make_mechanism, register_mechanism

__all__ = ["MECHANISMS", "NoiseMechanism", "make_mechanism", "register_mechanism"]
