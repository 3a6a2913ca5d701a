"""Per-sample gradient clipping through layer hooks (docs/design.md section 4).

Engines: ``flat`` (materialised per-sample gradients), ``ghost`` (Gram-matrix norms, Li et al. 2022), ``fgc`` (Lee &
Kifer 2021), ``mixed`` (Bu et al. 2023), ``hutch`` and ``hutchpp`` (randomized norms, DP-SGD-RC seed);
``clipping="auto"``, the default of the privacy options, runs ``mixed`` for l2 and ``flat`` for l1 clipping
(:func:`~lightning_dp.clipping.engines.base.auto_engine`). Layer families (one file each, registered by layer type):
``linear``, ``hf_conv1d``, ``conv``, ``conv_transpose``, ``embedding``, ``norms``, ``positional``,
``weight_standardised_conv`` (:class:`~lightning_dp.weight_standardisation.WSConv2d`). Modules that use
their parameters inside fused functions are swapped in place to equivalent classes calling hooked proxies (``swaps``):
``attention`` (``nn.MultiheadAttention``), ``recurrent`` (``nn.RNN``/``LSTM``/``GRU``), ``layers.positional``
(torchvision's ViT).

Layout: ``engines/`` (the engines and their registry), ``layers/`` (the layer families and their registry),
``swaps/`` (the module swaps), beside the machinery of the clipper: ``clipper`` (:class:`PerSampleClipper`, the clip
sequence), ``hooks`` (the captures), ``terms`` (per-sample gradient terms), ``sample_norms`` (the backward pass and
the norms), ``clipped_sum`` (book-keeping), ``past_iterates`` (per-sample momentum), ``groups`` (group-wise
clipping), ``multiplicity`` (augmentation multiplicity), ``rounding`` (rounding allowances), ``sum_check`` (the
per-sample sum check) and ``validation`` (which modules to hook and which to reject).
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
