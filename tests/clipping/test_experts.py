"""Mixture-of-experts layers (clipping/layers/experts.py): a top-k router and experts fused into 3-D weights, as HF
builds them, exact against a loop over examples under every exact engine (tokens folded into the rows, an expert no
token of an example reached, HF Mixtral and Qwen2-MoE); routers and experts of other maths refused at attach."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from clipping_helpers import check_against_oracle, randomise
from torch import nn

from lightning_dp.clipping import PerSampleClipper, UnsupportedModuleError

EXACT = ("flat", "ghost", "fgc", "mixed")
B, T, D, E = 3, 4, 6, 4


class TinyTopKRouter(nn.Module):
    def __init__(self, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.zeros(E, D))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)
        values, indices = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return logits, values / values.sum(-1, keepdim=True), indices


class TinyExperts(nn.Module):
    def __init__(self, hidden: int = 5, swapped: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * hidden, D))
        self.down_proj = nn.Parameter(torch.zeros(E, D, hidden))
        self.act_fn = nn.SiLU()
        self.swapped = swapped

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in range(E):
            tokens, slots = torch.where(top_k_index == expert)
            gate, up = F.linear(x[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            if self.swapped:
                gate, up = up, gate
            hidden = F.linear(self.act_fn(gate) * up, self.down_proj[expert]) * top_k_weights[tokens, slots, None]
            out = out.index_add(0, tokens, hidden)
        return out


class TinyMoe(nn.Module):
    """Embedding, then a sparse MoE block on the rows ``[B T, d]`` (HF's layout), then a head."""

    def __init__(self, top_k: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, D)
        self.gate, self.experts = TinyTopKRouter(top_k), TinyExperts()
        self.head = nn.Linear(D, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        rows = h.reshape(-1, D)
        _, weights, index = self.gate(rows)
        return self.head(h + self.experts(rows, index, weights).view(h.shape))


def loop_oracle(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn) -> dict[str, torch.Tensor]:
    """Per-example gradients by a loop over examples (routing is data-dependent: no vmap)."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    grads: dict[str, list[torch.Tensor]] = {n: [] for n in named}
    for i in range(inputs[0].shape[0]):
        loss = loss_fn(model, tuple(x[i : i + 1] for x in inputs)).sum()
        values = torch.autograd.grad(loss, list(named.values()), allow_unused=True)
        for name, value in zip(named, values, strict=True):
            grads[name].append(torch.zeros_like(named[name]) if value is None else value)
    return {n: torch.stack(v) for n, v in grads.items()}


def _ids() -> torch.Tensor:
    return torch.randint(0, 20, (B, T), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("clipping", EXACT)
@pytest.mark.parametrize("top_k", [1, 2])
def test_router_and_fused_experts_match_a_loop_over_examples(clipping: str, top_k: int) -> None:
    model = randomise(TinyMoe(top_k))
    check_against_oracle(model, (_ids(),), clipping, oracle=loop_oracle)


def test_an_expert_no_token_of_an_example_reached_gets_zero_for_it() -> None:
    model = randomise(TinyMoe(top_k=1))
    ids = _ids()
    grads = loop_oracle(model, (ids,), lambda m, x: m(*x).sin().flatten(1).sum(1))
    with torch.no_grad():
        _, _, index = model.gate(model.embed(ids).reshape(-1, D))
    reached = F.one_hot(index.view(B, -1), E).sum(1) > 0  # [B, E]
    assert not reached.all(), "the batch should leave some expert unreached by some example"
    blocks = grads["experts.down_proj"].flatten(2).abs().amax(2)  # [B, E]
    assert torch.equal(blocks > 0, reached)


@pytest.mark.parametrize(
    ("module", "match"),
    [
        (lambda: TinyExperts(swapped=True), "other than down"),
        (lambda: _ScoresFirstRouter(), "first output is not the logits"),
    ],
)
def test_routers_and_experts_of_other_maths_are_refused_at_attach(module, match) -> None:
    with pytest.raises(UnsupportedModuleError, match=match):
        PerSampleClipper(randomise(module()), max_grad_norm=1.0)


class _ScoresFirstRouter(TinyTopKRouter):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, scores, index = super().forward(x)
        return scores, logits, index


def _lm_loss(forward, inputs) -> torch.Tensor:
    logits = forward(*inputs).logits
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), inputs[0][:, 1:], reduction="none").mean(1)


@pytest.mark.parametrize("architecture", ["mixtral", "qwen2_moe"])
def test_hf_mixture_of_experts_is_exact(architecture: str) -> None:
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts_per_tok=2,
        attn_implementation="eager",
        experts_implementation="eager",  # the default grouped_mm has no float64 kernel
    )
    if architecture == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=24, num_local_experts=4, **common)
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen2MoeConfig(
            intermediate_size=24, moe_intermediate_size=12, shared_expert_intermediate_size=20, num_experts=4, **common
        )
        model = transformers.Qwen2MoeForCausalLM(config)
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (B, 5), generator=torch.Generator().manual_seed(1))
    check_against_oracle(model.double(), (ids,), "mixed", loss_fn=_lm_loss, atol=1e-9, oracle=loop_oracle)
