"""nn.MultiheadAttention under per-sample clipping: the in-place swap keeps parameters, state_dict and outputs, and
per-sample norms and clipped sums match the torch.func oracle of the original module."""

from __future__ import annotations

import copy

import pytest
import torch
from clipping_helpers import ENGINES, check_against_oracle, rand, randomise
from torch import nn

from lightning_dp.clipping import PerSampleClipper, UnsupportedModuleError
from lightning_dp.clipping.swaps.attention import DPMultiheadAttention

pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop")

B, L, S, E = 3, 5, 4, 8


class Attention(nn.Module):
    """Self- or cross-attention returning the attention output only; masks and options fixed at construction."""

    def __init__(self, mode: str = "self", batch_first: bool = True, need_weights: bool = False, **mha) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(E, 2, batch_first=batch_first, **mha)
        self.mode, self.need_weights, self.masks, self.per_sample = mode, need_weights, {}, ()

    def forward(self, x: torch.Tensor, memory: torch.Tensor, *per_sample_masks: torch.Tensor) -> torch.Tensor:
        """``per_sample_masks``: ``key_padding_mask`` ``[B, S]`` and/or a float ``attn_mask`` ``[B, H, L, S]`` (the
        sample dimension first, so that the oracle can vmap over them), named by ``self.per_sample``."""
        masks = dict(self.masks)
        for name, mask in zip(self.per_sample, per_sample_masks, strict=True):
            masks[name] = mask.flatten(0, 1) if name == "attn_mask" else mask
        if not self.attn.batch_first:
            x, memory = x.transpose(0, 1), memory.transpose(0, 1)
        key = value = x if self.mode == "self" else memory
        if self.mode == "cross3":
            value = memory * 2.0
        out, weights = self.attn(x, key, value, need_weights=self.need_weights, **masks)
        out = out if self.attn.batch_first else out.transpose(0, 1)
        return out if weights is None else out + weights.square().sum(-1, keepdim=True)  # [B, L, 1]


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return rand(B, L, E, seed=1), rand(B, S, E, seed=2)


CASES = {
    "self": dict(),
    "self_seq_first": dict(batch_first=False),
    "self_need_weights": dict(need_weights=True),
    "cross_kv": dict(mode="cross"),
    "cross_qkv_seq_first_no_bias": dict(mode="cross3", batch_first=False, bias=False),
}


@pytest.mark.parametrize("clipping", ENGINES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_matches_oracle(case: str, clipping: str) -> None:
    model = randomise(Attention(**CASES[case]))
    clipper = check_against_oracle(model, _inputs(), clipping)
    assert type(model.attn) is DPMultiheadAttention
    clipper.detach()
    assert type(model.attn) is nn.MultiheadAttention


def _padding(src: int) -> torch.Tensor:
    padding = torch.zeros(B, src, dtype=torch.bool)
    padding[0, -2:] = True
    return padding


def _causal(src: int) -> torch.Tensor:
    return torch.triu(torch.ones(L, src, dtype=torch.bool), diagonal=1)


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("clipping", ["flat", "ghost", "mixed"])
def test_attention_with_masks_matches_oracle(clipping: str, need_weights: bool) -> None:
    model = randomise(Attention(mode="cross", need_weights=need_weights))
    model.masks, model.per_sample = {"attn_mask": _causal(S)}, ("key_padding_mask",)
    check_against_oracle(model, (*_inputs(), _padding(S)), clipping)
    model = randomise(Attention(need_weights=need_weights))
    model.masks = {"attn_mask": _causal(L), "is_causal": True}
    check_against_oracle(model, _inputs(), clipping)
    model = randomise(Attention(need_weights=need_weights))
    model.per_sample = ("attn_mask",)  # float mask per sample and head
    check_against_oracle(model, (*_inputs(), rand(B, 2, L, L, seed=5)), clipping)


def test_swap_preserves_parameters_state_dict_and_outputs() -> None:
    torch.manual_seed(0)
    model = Attention(mode="cross").eval()
    model.masks = {"attn_mask": _causal(S), "key_padding_mask": _padding(S)}
    params = dict(model.named_parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x, memory = (t.float() for t in _inputs())
    with torch.no_grad():
        before = model.attn(x, memory, memory, need_weights=True, **model.masks)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # built before attaching
    clipper = PerSampleClipper(model, clipping="ghost", max_grad_norm=1.0)
    assert isinstance(model.attn, nn.MultiheadAttention)
    assert dict(model.named_parameters()) == params  # same names, same objects
    assert list(model.state_dict()) == list(state)
    with torch.no_grad():
        after = model.attn(x, memory, memory, need_weights=True, **model.masks)
        fast = model.attn(x, memory, memory, need_weights=False, **model.masks)[0]
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fast, before[0], rtol=1e-6, atol=1e-6)
    model.train()
    clipper.backward(model(x, memory).sum((1, 2)))
    optimizer.step()
    assert not torch.equal(model.attn.in_proj_weight, state["attn.in_proj_weight"])
    model.load_state_dict(state)  # strict: no missing or unexpected key
    assert torch.equal(model.attn.in_proj_weight, state["attn.in_proj_weight"])
    copied = copy.deepcopy(model)
    assert type(copied.attn) is DPMultiheadAttention and copied.attn.dp_in_proj.weight is copied.attn.in_proj_weight
    clipper.detach()
    assert type(model.attn) is nn.MultiheadAttention and not hasattr(model.attn, "dp_in_proj")
    assert list(model.state_dict()) == list(state)


def test_frozen_attention_is_not_swapped() -> None:
    model = Attention()
    model.attn.requires_grad_(False)
    model.add_module("head", nn.Linear(E, 2))
    PerSampleClipper(model, max_grad_norm=1.0)
    assert type(model.attn) is nn.MultiheadAttention


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(kdim=4, vdim=4), "kdim/vdim"),
        (dict(add_bias_kv=True), "add_bias_kv=False"),
        (dict(add_zero_attn=True), "add_zero_attn=False"),
    ],
)
def test_unsupported_attention_options_rejected(options: dict, match: str) -> None:
    model = Attention(**options)
    with pytest.raises(UnsupportedModuleError, match=rf"'attn'.*{match}"):
        PerSampleClipper(model, max_grad_norm=1.0)
    assert type(model.attn) is nn.MultiheadAttention


def test_unbatched_attention_rejected() -> None:
    model = Attention()
    PerSampleClipper(model, max_grad_norm=1.0)
    x = torch.randn(L, E)
    with pytest.raises(ValueError, match="batched attention inputs"):
        model.attn(x, x, x)


@pytest.mark.parametrize("clipping", ["flat", "ghost", "mixed"])
def test_transformer_encoder_layer(clipping: str) -> None:
    layer = nn.TransformerEncoderLayer(E, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    model = randomise(nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(E, 2)))
    check_against_oracle(model, (rand(B, L, E),), clipping)
