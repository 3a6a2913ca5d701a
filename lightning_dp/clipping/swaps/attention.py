"""``nn.MultiheadAttention`` through hooked linear layers: an in-place, weight-preserving swap
(:mod:`~lightning_dp.clipping.swaps.base`).

The swapped class computes the same function (Vaswani et al. 2017, "Attention is all you need", Section 3.2; the
semantics of ``F.multi_head_attention_forward``) with ``dp_in_proj`` (a ``SharedLinear`` over
``in_proj_weight``/``in_proj_bias``, called once per distinct input) and ``out_proj`` as hooked calls, on
batch-first tensors. Rejected at attach: ``kdim``/``vdim`` != ``embed_dim``, ``add_bias_kv``, ``add_zero_attn``;
unbatched inputs are rejected at the call.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from lightning_dp.clipping.swaps.base import SharedLinear, SwappedModule, register_swap


@register_swap(nn.MultiheadAttention)
class DPMultiheadAttention(nn.MultiheadAttention, SwappedModule):
    """``nn.MultiheadAttention`` with its projections as hooked layer calls; see the module docstring."""

    dp_in_proj: SharedLinear  # added by add_proxies

    @classmethod
    def swap_problem(cls, module: nn.Module) -> str | None:
        """Reject the configurations listed in the module docstring."""
        if not module._qkv_same_embed_dim:
            return (
                "kdim/vdim different from embed_dim are not supported by per-sample clipping; project key/value "
                "to embed_dim with an nn.Linear before the attention"
            )
        if module.bias_k is not None:
            return "add_bias_kv=True is not supported by per-sample clipping; set add_bias_kv=False"
        if module.add_zero_attn:
            return "add_zero_attn=True is not supported by per-sample clipping; set add_zero_attn=False"
        return None

    def add_proxies(self) -> list[str]:
        """Add ``dp_in_proj`` sharing ``in_proj_weight``/``in_proj_bias``."""
        self.add_module("dp_in_proj", SharedLinear(self.in_proj_weight, self.in_proj_bias))
        return ["dp_in_proj"]

    def _project(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> list[torch.Tensor]:
        """q, k, v ``[B, L or S, E]`` through ``dp_in_proj`` (one call per distinct input)."""
        if key is query and value is query:
            return list(self.dp_in_proj(query).chunk(3, dim=-1))
        e = self.embed_dim
        if value is key:
            return [self.dp_in_proj(query)[..., :e], *self.dp_in_proj(key)[..., e:].chunk(2, dim=-1)]
        return [self.dp_in_proj(x)[..., i * e : (i + 1) * e] for i, x in enumerate((query, key, value))]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As ``nn.MultiheadAttention.forward`` (batched inputs only).

        Raises:
            ValueError: an unbatched (2-D) query: per-sample clipping needs a sample dimension.
            RuntimeError: ``is_causal=True`` without ``attn_mask`` (as the original).
        """
        if query.dim() != 3:
            raise ValueError(
                f"per-sample clipping needs batched attention inputs (3-D), got a query of shape {tuple(query.shape)}"
            )
        same_kv, self_attention = value is key, key is query and value is query
        if not self.batch_first:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
            if self_attention:
                key = value = query
            elif same_kv:
                value = key
        batch, tgt_len, _ = query.shape
        src_len = key.shape[1]
        heads, head_dim = self.num_heads, self.head_dim

        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint (as nn.MultiheadAttention)")
        key_padding_mask = F._canonical_mask(
            mask=key_padding_mask,
            mask_name="key_padding_mask",
            other_type=F._none_or_dtype(attn_mask),
            other_name="attn_mask",
            target_type=query.dtype,
        )
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None  # the hint alone, as F.multi_head_attention_forward does for SDPA
        else:
            attn_mask = F._canonical_mask(
                mask=attn_mask,
                mask_name="attn_mask",
                other_type=None,
                other_name="",
                target_type=query.dtype,
                check_other=False,
            )
            is_causal = is_causal and key_padding_mask is None
        if attn_mask is not None:
            attn_mask = attn_mask.view(batch, heads, tgt_len, src_len) if attn_mask.dim() == 3 else attn_mask
        if key_padding_mask is not None:
            padding = key_padding_mask.view(batch, 1, 1, src_len)
            attn_mask = padding if attn_mask is None else attn_mask + padding

        q, k, v = (
            x.reshape(batch, -1, heads, head_dim).transpose(1, 2) for x in self._project(query, key, value)
        )  # [B, H, L or S, head_dim]
        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = (q * math.sqrt(1.0 / head_dim)) @ k.transpose(-2, -1)
            if attn_mask is not None:
                scores = scores + attn_mask
            weights = scores.softmax(dim=-1)
            attn = F.dropout(weights, p=dropout_p) @ v if dropout_p > 0 else weights @ v
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        out = self.out_proj(attn.transpose(1, 2).reshape(batch, tgt_len, self.embed_dim))
        return (out if self.batch_first else out.transpose(0, 1)), weights
