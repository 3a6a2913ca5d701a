"""Per-sample gradient clipping through layer hooks (docs/design.md section 4; layout: section 2.1).

Engines (``engines/``): ``flat``, ``ghost`` (Li et al. 2022), ``fgc`` (Lee & Kifer 2021), ``mixed`` (Bu et al.
2023), ``hutch``/``hutchpp`` (DP-SGD-RC seed); ``clipping="auto"`` runs ``mixed`` for l2 and ``flat`` for l1. Layer
families in ``layers/``, module swaps in ``swaps/``; the clipper is :class:`PerSampleClipper`.
"""

from lightning_dp.clipping import engines, layers, swaps  # noqa: F401 (registration; layers before swaps)
from lightning_dp.clipping.clipper import PerSampleClipper
from lightning_dp.clipping.engines.base import (
    AUTO,
    ENGINES,
    ClippingEngine,
    auto_engine,
    clipping_choices,
    make_clipping_engine,
    register_engine,
)
from lightning_dp.clipping.layers.registry import (
    UnsupportedModuleError,
    find_layer_family,
    register_layer,
    register_layer_rule,
)

__all__ = [
    "AUTO",
    "ENGINES",
    "ClippingEngine",
    "PerSampleClipper",
    "UnsupportedModuleError",
    "auto_engine",
    "clipping_choices",
    "find_layer_family",
    "make_clipping_engine",
    "register_engine",
    "register_layer",
    "register_layer_rule",
]
