"""Module swaps (docs/design.md section 4.1): ``base``, ``attention`` (``nn.MultiheadAttention``), ``recurrent``
(``nn.RNN``/``LSTM``/``GRU``), ``inner_call`` (subclasses of a supported layer wrapping its forward),
``relative_bias`` (T5's relative position bias, per example). Importing the package registers the built-in swaps
(torchvision's ViT swaps live in :mod:`~lightning_dp.clipping.layers.positional`).
"""

from lightning_dp.clipping.swaps import attention, inner_call, recurrent, relative_bias  # noqa: F401 (registration)
