"""Layer families (docs/design.md section 4.2): ``registry``, ``activations`` (PReLU), ``conv``, ``conv_transpose``,
``embedding`` (and ``nn.EmbeddingBag``), ``experts`` (mixture-of-experts routers and fused experts), ``fallback``,
``linear``, ``hf_conv1d`` (registered once ``transformers.pytorch_utils`` is imported), ``norms``, ``positional``,
``weight_standardised_conv``. Importing the package registers the built-in families (rules: scale-only
RMS norms, HF ViT embeddings, then MoE routers and fused experts).
"""

from lightning_dp.clipping.layers import (  # noqa: F401 (registration)
    activations,
    conv,
    conv_transpose,
    embedding,
    experts,
    hf_conv1d,
    linear,
    norms,
    positional,
    weight_standardised_conv,
)
