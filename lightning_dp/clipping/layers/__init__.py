"""Layer families: the per-sample gradient terms of each supported layer, registered by layer type or rule.

- ``registry``: :class:`LayerFamily`, ``register_layer``, ``register_layer_rule``, ``find_layer_family`` and
  :class:`UnsupportedModuleError`;
- ``conv``: ``nn.Conv1d``/``2d``/``3d``, by unfolding into a linear layer;
- ``conv_transpose``: ``nn.ConvTranspose1d``/``2d``/``3d``, as the adjoint convolution;
- ``embedding``: ``nn.Embedding`` (ids as the left factor);
- ``linear``: ``nn.Linear`` (and the affine terms shared with ``hf_conv1d``);
- ``hf_conv1d``: HuggingFace ``Conv1D``, registered once ``transformers.pytorch_utils`` is imported;
- ``norms``: LayerNorm, GroupNorm, InstanceNorm, RMSNorm and scale-only RMS norms (by rule);
- ``positional``: learned position embeddings and prepended tokens (the proxies of torchvision's ViT swaps, which
  it registers, and HF ViT embeddings by rule);
- ``weight_standardised_conv``: :class:`~lightning_dp.weight_standardisation.WSConv2d`.

Importing this package registers the built-in families (rules in the order: scale-only RMS norms, HF ViT embeddings).
"""

from lightning_dp.clipping.layers import (  # noqa: F401 (registration)
    conv,
    conv_transpose,
    embedding,
    hf_conv1d,
    linear,
    norms,
    positional,
    weight_standardised_conv,
)
