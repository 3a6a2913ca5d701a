"""Per-sample gradient terms for learned position embeddings and prepended tokens (ViT), and the swaps that route
torchvision's ViT through them.

``y = x + P`` (``P`` ``[1, *shape]``) gives ``grad P_i = G_i``; ``y = cat(T, x)`` (``T`` ``[1, n, D]``) gives ``grad
T_i = G_i[:n]`` (Dosovitskiy et al. 2021, "An image is worth 16x16 words", Eq. 1); both materialised. torchvision
``VisionTransformer``/``Encoder`` are swapped by class name (not imported); HF ``ViTEmbeddings`` is covered by a rule,
exact with ``hidden_dropout_prob = 0`` and rejected otherwise or with a trainable ``mask_token``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from lightning_dp.clipping.layers.registry import register_layer, register_layer_rule
from lightning_dp.clipping.swaps.base import Proxy, SwappedModule, register_swap
from lightning_dp.clipping.terms import Materialised, Term, compute_dtype, tensor, trainable


class SharedPositionAdd(Proxy):
    """``y = x + weight`` for another module's ``weight`` ``[1, *shape]``; input ``[B, *shape]``."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight


class SharedTokenPrepend(Proxy):
    """``y = cat(weight.expand(B, n, D), x)`` along dim 1 for another module's ``weight`` ``[1, n, D]``; input
    ``[B, T, D]``, output ``[B, n + T, D]``."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.weight.expand(x.shape[0], -1, -1), x], dim=1)


def _broadcast_grad(param: torch.Tensor, grads: torch.Tensor, what: str) -> Materialised:
    """``grad_i = G_i`` reshaped to ``param`` ``[1, *shape]`` (``G`` ``[B, *shape]``)."""
    if tuple(grads.shape[1:]) != tuple(param.shape[1:]):
        raise ValueError(
            f"{what}: output gradient of shape {tuple(grads.shape)} does not match the parameter {tuple(param.shape)} "
            "broadcast over the batch (an interpolated or sliced position embedding is not supported)"
        )
    return Materialised(grads.to(compute_dtype(param)).reshape(grads.shape[0], *param.shape))


@register_layer(SharedPositionAdd)
def position_add_terms(
    layer: SharedPositionAdd, activation: torch.Tensor, output_grad: torch.Tensor
) -> dict[str, Term]:
    """Term for ``weight`` ``[1, *shape]``: ``grad_i = G_i`` (output gradient ``[B, *shape]``)."""
    return (
        {"weight": _broadcast_grad(layer.weight, output_grad, "position embedding")}
        if trainable(layer, "weight")
        else {}
    )


@register_layer(SharedTokenPrepend)
def token_prepend_terms(
    layer: SharedTokenPrepend, activation: torch.Tensor, output_grad: torch.Tensor
) -> dict[str, Term]:
    """Term for ``weight`` ``[1, n, D]``: ``grad_i = G_i[:n]`` (output gradient ``[B, n + T, D]``)."""
    if not trainable(layer, "weight"):
        return {}
    return {"weight": _broadcast_grad(layer.weight, output_grad[:, : layer.weight.shape[1]], "prepended token")}


@register_swap("torchvision.models.vision_transformer.Encoder")
class DPTorchvisionEncoder(SwappedModule):
    """torchvision ``Encoder`` with ``input + pos_embedding`` through a :class:`SharedPositionAdd` proxy."""

    # torchvision's Encoder's (this class is mixed into it), and the proxy
    pos_embedding: nn.Parameter
    dropout: nn.Module
    layers: nn.Module
    ln: nn.Module
    dp_pos_embedding: SharedPositionAdd

    def add_proxies(self) -> list[str]:
        self.add_module("dp_pos_embedding", SharedPositionAdd(self.pos_embedding))
        return ["dp_pos_embedding"]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """As torchvision's ``Encoder.forward``: ``ln(layers(dropout(input + pos_embedding)))``, input ``[B, S, D]``."""
        if input.dim() != 3:
            raise ValueError(f"Expected (batch_size, seq_length, hidden_dim) got {tuple(input.shape)}")
        return self.ln(self.layers(self.dropout(self.dp_pos_embedding(input))))


@register_swap("torchvision.models.vision_transformer.VisionTransformer")
class DPTorchvisionViT(SwappedModule):
    """torchvision ``VisionTransformer`` with the class token prepended through a :class:`SharedTokenPrepend`."""

    # torchvision's VisionTransformer's (this class is mixed into it), and the proxy
    class_token: nn.Parameter
    encoder: nn.Module
    heads: nn.Module
    _process_input: Callable[[torch.Tensor], torch.Tensor]
    dp_class_token: SharedTokenPrepend

    def add_proxies(self) -> list[str]:
        self.add_module("dp_class_token", SharedTokenPrepend(self.class_token))
        return ["dp_class_token"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """As torchvision's ``VisionTransformer.forward``: images ``[B, C, H, W]`` -> logits ``[B, num_classes]``."""
        x = self.encoder(self.dp_class_token(self._process_input(x)))
        return self.heads(x[:, 0])


def _is_hf_vit_embeddings(module: nn.Module) -> bool:
    return type(module).__name__ == "ViTEmbeddings" and type(module).__module__.startswith("transformers.")


def _check_hf_vit_embeddings(layer: nn.Module) -> str | None:
    dropout = cast(nn.Dropout, layer.dropout)
    if dropout.p > 0:
        return (
            f"its dropout (p={dropout.p}) follows the position embedding, so that embedding's per-sample "
            "gradient cannot be recovered; set hidden_dropout_prob=0.0 (the ViT default)"
        )
    if trainable(layer, "mask_token"):
        return "a trainable mask_token (use_mask_token=True) is not supported; freeze it (requires_grad=False)"
    return None


def hf_vit_embeddings_terms(layer: nn.Module, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Term]:
    """Terms for ``cls_token`` ``[1, 1, D]`` (``G_i[:1]``) and ``position_embeddings`` ``[1, 1 + N, D]`` (``G_i``)
    from the output gradient ``[B, 1 + N, D]`` of HF ``ViTEmbeddings``."""
    terms: dict[str, Term] = {}
    if trainable(layer, "cls_token"):
        cls_token = tensor(layer, "cls_token")
        terms["cls_token"] = _broadcast_grad(cls_token, output_grad[:, : cls_token.shape[1]], "cls_token")
    if trainable(layer, "position_embeddings"):
        position = tensor(layer, "position_embeddings")
        terms["position_embeddings"] = _broadcast_grad(position, output_grad, "position_embeddings")
    return terms


register_layer_rule(_is_hf_vit_embeddings, check=_check_hf_vit_embeddings)(hf_vit_embeddings_terms)
