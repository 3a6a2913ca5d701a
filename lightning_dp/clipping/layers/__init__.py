"""Layer families (docs/design.md section 4.2): ``registry``, ``activations`` (PReLU), ``conv``, ``conv_transpose``,
``embedding``, ``linear``, ``hf_conv1d`` (registered once ``transformers.pytorch_utils`` is imported), ``norms``,
``positional``, ``weight_standardised_conv``. Importing the package registers the built-in families (rules: scale-only
RMS norms, then HF ViT embeddings).
"""

from lightning_dp.clipping.layers import (  # noqa: F401 (registration)
    activations,
    conv,
    conv_transpose,
    embedding,
    hf_conv1d,
    linear,
    norms,
    positional,
    weight_standardised_conv,
)
