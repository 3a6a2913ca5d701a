"""Per-sample gradient clipping through layer hooks (DESIGN.md section 4).

Engines: ``flat`` (materialised per-sample gradients) and ``ghost`` (Gram-matrix norms, Li et al. 2022). Layer
families (one file each, registered by layer type): ``linear``, ``hf_conv1d``, ``conv``, ``embedding``, ``norms``.
"""

from lightning_dp.clipping import conv, embedding, flat, ghost, hf_conv1d, linear, norms  # noqa: F401 (registration)
from lightning_dp.clipping.clipper import PerSampleClipper
from lightning_dp.clipping.engine import ENGINES, ClippingEngine, register_engine
from lightning_dp.clipping.registry import (
    UnsupportedModuleError,
    find_layer_family,
    register_layer,
    register_layer_rule,
)

__all__ = [
    "ENGINES",
    "ClippingEngine",
    "PerSampleClipper",
    "UnsupportedModuleError",
    "find_layer_family",
    "register_engine",
    "register_layer",
    "register_layer_rule",
]
