"""Module swaps: modules that use their parameters outside any hookable layer call, changed in place into
equivalent classes that route every use through hooked proxy layers.

- ``base``: :class:`Proxy`, :class:`SharedLinear`, :class:`SwappedModule`, ``register_swap``, ``swap_modules`` and
  ``restore_modules``;
- ``attention``: ``nn.MultiheadAttention``;
- ``recurrent``: ``nn.RNN``, ``nn.LSTM`` and ``nn.GRU``, unrolled over time.

Importing this package registers the built-in swaps (torchvision's ViT swaps live with their layer families, in
:mod:`~lightning_dp.clipping.layers.positional`).
"""

from lightning_dp.clipping.swaps import attention, recurrent  # noqa: F401 (registration)
