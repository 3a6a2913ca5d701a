"""Mixture-of-experts layers (clipping/layers/experts.py): a top-k router and experts fused into 3-D weights, as HF
builds them, exact against a loop over examples under every exact engine (tokens folded into the rows, an expert no
token of an example reached, HF Mixtral and Qwen2-MoE); routers and experts of other maths refused at attach. Then
peft LoRA on the experts' fused weights (``LoraConfig(target_parameters=...)``, peft's ``ParamWrapper``): exact the
same way, and refused at attach where it cannot be (the experts' own weights trainable, other maths, another layout
of the factors, a ``ParamWrapper`` on other than fused experts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from clipping_helpers import check_against_oracle, randomise
from torch import nn

from lightning_dp.clipping import PerSampleClipper, UnsupportedModuleError, auto_engine

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
    model = _hf_moe(architecture, hidden=16, layers=1)
    ids = torch.randint(0, 50, (B, 5), generator=torch.Generator().manual_seed(1))
    check_against_oracle(model, (ids,), "mixed", loss_fn=_lm_loss, atol=1e-9, oracle=loop_oracle)


@pytest.mark.parametrize("clipping", ["auto", "ghost", "flat"])
@pytest.mark.parametrize("architecture", ["mixtral", "qwen2_moe"])
def test_hf_lora_on_fused_experts_is_exact(architecture: str, clipping: str) -> None:
    """peft LoRA on HF's experts (``mlp.experts.gate_up_proj`` ``[E, 2f, d]``, ``mlp.experts.down_proj``), hidden 32,
    2 layers, 4 experts: only the LoRA factors of the experts trainable."""
    targets = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    model = with_lora(_hf_moe(architecture, hidden=32, layers=2), targets=targets)
    assert sum(p.requires_grad for p in model.parameters()) == 8  # lora_A and lora_B of 2 weights in 2 layers
    ids = torch.randint(0, 50, (B, 5), generator=torch.Generator().manual_seed(1))
    engine = auto_engine(2)[0] if clipping == "auto" else clipping
    check_against_oracle(model, (ids,), engine, loss_fn=_lm_loss, atol=1e-9, oracle=loop_oracle)


# ------------------------------------------------------------------- peft LoRA on the experts' fused weights
EXPERT_WEIGHTS = ("experts.gate_up_proj", "experts.down_proj")


def with_lora(model: nn.Module, targets: tuple[str, ...] = EXPERT_WEIGHTS, rank: int = 2, seed: int = 1) -> nn.Module:
    """``model`` (float64) with peft LoRA on ``targets`` through ``LoraConfig(target_parameters=...)`` (peft's
    ``ParamWrapper``), the rest frozen; the LoRA factors random (``B`` away from 0)."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[], target_parameters=list(targets))
    lora = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return lora


@pytest.mark.parametrize("clipping", EXACT)
@pytest.mark.parametrize("top_k", [1, 2])
def test_lora_on_fused_experts_matches_a_loop_over_examples(clipping: str, top_k: int) -> None:
    model = with_lora(randomise(TinyMoe(top_k)))
    assert all("lora_" in name for name, p in model.named_parameters() if p.requires_grad)
    check_against_oracle(model, (_ids(),), clipping, oracle=loop_oracle)


def test_lora_on_one_expert_weight_with_two_active_adapters_matches_a_loop_over_examples() -> None:
    peft = pytest.importorskip("peft")
    model = with_lora(randomise(TinyMoe()), targets=("experts.down_proj",))
    config = peft.LoraConfig(r=3, lora_alpha=3, target_modules=[], target_parameters=["experts.down_proj"])
    model.add_adapter("second", config)
    model.base_model.set_adapter(["default", "second"])
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.requires_grad_(True).copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    check_against_oracle(model, (_ids(),), "ghost", oracle=loop_oracle)


def test_lora_factors_of_an_expert_no_token_of_an_example_reached_get_zero_for_it() -> None:
    from lightning_dp.clipping.layers.experts import lora_fused_experts_terms
    from lightning_dp.clipping.layers.fallback import CapturedCall, own_parameters

    model = with_lora(randomise(TinyMoe(top_k=1)))
    moe, ids = model.base_model.model, _ids()
    calls: list[tuple[tuple[torch.Tensor, ...], torch.Tensor]] = []
    handle = moe.experts.register_forward_hook(lambda module, args, output: calls.append((args, output)))
    loss = model(ids).sin().flatten(1).sum()
    handle.remove()
    ((args, output),) = calls
    (output_grad,) = torch.autograd.grad(loss, output)
    own = own_parameters(moe.experts)  # the chain's LoRA factors, by dotted name
    values = {key: p.detach() for key, p in own.items()}
    terms = lora_fused_experts_terms(
        "experts", moe.experts, CapturedCall.record(args, {}, output), output_grad, values, T
    )

    expected = loop_oracle(model, (ids,), lambda m, x: m(*x).sin().flatten(1).sum(1))
    prefix = "base_model.model.experts."
    assert set(terms) == set(own) == {name.removeprefix(prefix) for name in expected}
    for key, term in terms.items():
        torch.testing.assert_close(term.materialise(), expected[prefix + key], rtol=1e-9, atol=1e-12, msg=key)
    with torch.no_grad():
        _, _, index = moe.gate(moe.embed(ids).reshape(-1, D))
    reached = F.one_hot(index.view(B, -1), E).sum(1) > 0  # [B, E]
    assert not reached.all(), "the batch should leave some expert unreached by some example"
    lora_a = terms["lora_A.default.weight"].materialise().view(B, E, -1)  # rows e r + k: expert e's
    lora_b = terms["base_layer.lora_B.default.weight"].materialise()  # [B, out, r E], column k E + e: expert e's
    lora_b = lora_b.view(B, lora_b.shape[1], -1, E).transpose(1, 3).reshape(B, E, -1)
    for per_expert in (lora_a, lora_b):
        assert torch.equal(per_expert.abs().amax(2) > 0, reached)


def test_lora_on_fused_experts_is_refused_at_attach_when_it_cannot_be_exact(monkeypatch) -> None:
    pytest.importorskip("peft")
    from peft.tuners.lora.layer import ParamWrapper

    trainable_base = with_lora(randomise(TinyMoe()))
    trainable_base.base_model.model.experts.base_layer.base_layer.down_proj.requires_grad_(True)
    with pytest.raises(UnsupportedModuleError, match=r"needs their own weights frozen, but down_proj are trainable"):
        PerSampleClipper(trainable_base, max_grad_norm=1.0)

    swapped = TinyMoe()
    swapped.experts = TinyExperts(swapped=True)
    with pytest.raises(UnsupportedModuleError, match="other than down"):
        PerSampleClipper(with_lora(randomise(swapped)), max_grad_norm=1.0)

    with pytest.raises(
        UnsupportedModuleError, match=r"supported on fused mixture-of-experts weights.*through target_modules"
    ):
        PerSampleClipper(with_lora(randomise(TinyMoe()), targets=("head.weight",)), max_grad_norm=1.0)

    # a peft whose factors are laid out otherwise (here: the experts' order reversed) is caught by the probe
    factors = ParamWrapper.get_delta_factors
    monkeypatch.setattr(ParamWrapper, "get_delta_factors", lambda self, name: _reversed(*factors(self, name)))
    with pytest.raises(UnsupportedModuleError, match=r"other than W_e \+ scaling B_e A_e"):
        PerSampleClipper(with_lora(randomise(TinyMoe())), max_grad_norm=1.0)


def _reversed(lhs: torch.Tensor, rhs: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    return lhs.flip(0), rhs.flip(0), scaling


def _hf_moe(architecture: str, hidden: int, layers: int):
    """A tiny HF Mixtral or Qwen2-MoE (4 experts, top 2, eager attention and experts), float64."""
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=50,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_experts_per_tok=2,
        attn_implementation="eager",
        experts_implementation="eager",  # the default grouped_mm has no float64 kernel
    )
    torch.manual_seed(0)
    if architecture == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=24, num_local_experts=4, **common)
        return transformers.MixtralForCausalLM(config).double()
    config = transformers.Qwen2MoeConfig(
        intermediate_size=24, moe_intermediate_size=12, shared_expert_intermediate_size=20, num_experts=4, **common
    )
    return transformers.Qwen2MoeForCausalLM(config).double()
