"""Per-sample gradient terms for ``nn.Embedding``: ``grad W_i = onehot(ids_i)^T G_i`` (no gradient at ``padding_idx``),
ghost norm ``sum_{t,t'} [id_t == id_t'] <g_t, g_t'>`` (Li et al. 2022, Section 4). Broadcast ids ``[1, T]`` are
expanded to the batch (``expand_batch=True``).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_dp.clipping.layers.registry import register_layer
from lightning_dp.clipping.terms import Factored, Term, compute_dtype


def _check_embedding(layer: nn.Embedding) -> str | None:
    if layer.scale_grad_by_freq:
        return "scale_grad_by_freq=True scales gradients by token counts over the whole batch, which mixes samples"
    return None


@register_layer(nn.Embedding, expand_batch=True, check=_check_embedding)
def embedding_terms(layer: nn.Embedding, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Term]:
    """Term for ``weight`` ``[num_embeddings, embedding_dim]`` as ids (left) and output grads (right).

    Args:
        layer: the embedding.
        activation: integer ids ``[B, *lead]``.
        output_grad: gradient w.r.t. the output ``[B, *lead, embedding_dim]``.
    """
    if not layer.weight.requires_grad:
        return {}
    ids = activation.reshape(activation.shape[0], -1)
    grads = output_grad.reshape(output_grad.shape[0], -1, layer.embedding_dim).to(compute_dtype(layer.weight))
    if layer.padding_idx is not None:
        grads = grads.masked_fill((ids == layer.padding_idx).unsqueeze(-1), 0.0)
    return {"weight": Factored(ids, grads, layer.weight.shape)}
