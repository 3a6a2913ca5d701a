"""Per-sample gradient terms for ``nn.Embedding``: ``grad W_i = onehot(ids_i)^T G_i`` (no gradient at ``padding_idx``),
ghost norm ``sum_{t,t'} [id_t == id_t'] <g_t, g_t'>`` (Li et al. 2022, Section 4). Broadcast ids ``[1, T]`` are
expanded to the batch (``expand_batch=True``). ``nn.EmbeddingBag`` (``sum``/``mean``): bag ``i`` is example ``i``,
``grad W_i = sum_k w_ik onehot(id_ik)^T G_i`` with ``w_ik`` the per-sample weight (``sum``) or one over the bag's size
(``mean``), factored the same way over the bag's entries.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from lightning_dp.clipping.layers.fallback import CapturedCall
from lightning_dp.clipping.layers.registry import register_layer
from lightning_dp.clipping.multiplicity import fold_copies
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


def _check_bag(layer: nn.EmbeddingBag) -> str | None:
    if layer.mode == "max":
        return "mode='max' sends each coordinate's gradient to one entry of the bag; use mode='sum' or 'mean'"
    if layer.scale_grad_by_freq:
        return "scale_grad_by_freq=True scales gradients by token counts over the whole batch, which mixes samples"
    return None


_BAG_SIGNATURE = inspect.signature(nn.EmbeddingBag.forward)


def _bags(layer: nn.EmbeddingBag, call: CapturedCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Each bag's ids and entry weights, padded: ``[B, L]`` each (weight 0 past a bag's end and at ``padding_idx``;
    ``mean`` divides by the bag's size without padding entries)."""
    bound = _BAG_SIGNATURE.bind(layer, *call.args, **call.kwargs).arguments
    ids: torch.Tensor = bound["input"]
    offsets, entry_weights = bound.get("offsets"), bound.get("per_sample_weights")
    if ids.ndim == 2:
        valid = torch.ones_like(ids, dtype=torch.bool)
        weights = entry_weights if entry_weights is not None else torch.ones(ids.shape, device=ids.device)
    else:
        assert offsets is not None  # a 1-D input needs offsets (nn.EmbeddingBag raises otherwise)
        starts = offsets[:-1] if layer.include_last_offset else offsets
        ends = torch.cat([starts[1:], starts.new_tensor([ids.numel()])])
        if layer.include_last_offset:
            ends = offsets[1:]
        lengths = ends - starts
        width = max(int(lengths.max()) if lengths.numel() else 0, 1)
        position = torch.arange(width, device=ids.device)
        valid = position < lengths[:, None]
        index = (starts[:, None] + position).clamp(max=max(ids.numel() - 1, 0))
        flat = entry_weights if entry_weights is not None else torch.ones(ids.shape, device=ids.device)
        ids, weights = ids[index], flat[index]
    if layer.padding_idx is not None:
        valid = valid & (ids != layer.padding_idx)
    weights = torch.where(valid, weights, 0)
    if layer.mode == "mean":
        weights = weights / valid.sum(1, keepdim=True).clamp(min=1)
    return torch.where(valid, ids, 0), weights


@register_layer(nn.EmbeddingBag, check=_check_bag, captures_call=True)
def embedding_bag_terms(
    name: str,
    layer: nn.EmbeddingBag,
    call: CapturedCall,
    output_grad: torch.Tensor,
    values: dict[str, torch.Tensor],
    rows_per_example: int,
) -> dict[str, Term]:
    """Term for ``weight`` ``[num_embeddings, embedding_dim]``: ids ``[B, L]`` (left) and ``w_ik G_i`` ``[B, L, d]``
    (right), from the call's ``input`` (``[B, L]``, or 1-D with ``offsets``) and ``per_sample_weights``."""
    if not layer.weight.requires_grad:
        return {}
    ids, weights = _bags(layer, call)
    dtype = compute_dtype(layer.weight)
    right = output_grad.to(dtype)[:, None, :] * weights.to(dtype)[..., None]
    return {"weight": fold_copies(Factored(ids, right, layer.weight.shape), rows_per_example)}
