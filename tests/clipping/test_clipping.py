"""Per-sample clipping (exact engines, book-keeping) against a torch.func per-sample gradient oracle, in float64."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from clipping_helpers import (
    ENGINES,
    IDS,
    RTOL,
    B,
    FunctionalReuse,
    TiedLM,
    check_against_oracle,
    lm_loss,
    oracle_grads,
    oracle_norms,
    rand,
    randomise,
    sin_loss,
)
from torch import nn

from lightning_dp.clipping import PerSampleClipper, UnsupportedModuleError
from lightning_dp.clipping.hooks import Capture
from lightning_dp.clipping.layers.fallback import fallback_problem


def _hf_conv1d() -> nn.Module:
    from transformers.pytorch_utils import Conv1D

    return Conv1D(3, 5)


def _llama_rms_norm() -> nn.Module:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(5, eps=1e-5)


def _gemma_rms_norm() -> nn.Module:
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    return GemmaRMSNorm(5)


LAYER_CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "linear_2d": (lambda: nn.Linear(5, 3), lambda: rand(B, 5)),
    "linear_2d_nobias": (lambda: nn.Linear(5, 3, bias=False), lambda: rand(B, 5)),
    "linear_seq": (lambda: nn.Linear(5, 3), lambda: rand(B, 6, 5)),
    "linear_seq_4d": (lambda: nn.Linear(5, 3), lambda: rand(B, 2, 3, 5)),
    "linear_seq_nobias": (lambda: nn.Linear(5, 3, bias=False), lambda: rand(B, 6, 5)),
    "conv1d": (lambda: nn.Conv1d(3, 4, 3, stride=2, padding=1), lambda: rand(B, 3, 11)),
    "conv1d_groups_reflect": (
        lambda: nn.Conv1d(4, 6, 3, dilation=2, groups=2, padding=2, padding_mode="reflect", bias=False),
        lambda: rand(B, 4, 10),
    ),
    "conv2d": (lambda: nn.Conv2d(3, 4, 3, stride=2, padding=1, dilation=2), lambda: rand(B, 3, 9, 8)),
    "conv2d_nobias": (lambda: nn.Conv2d(3, 4, (2, 3), stride=(1, 2), bias=False), lambda: rand(B, 3, 7, 7)),
    "conv2d_groups": (lambda: nn.Conv2d(4, 6, 3, groups=2, padding="same"), lambda: rand(B, 4, 6, 6)),
    "conv2d_depthwise_circular": (
        lambda: nn.Conv2d(3, 3, 3, groups=3, padding=1, padding_mode="circular"),
        lambda: rand(B, 3, 5, 5),
    ),
    "embedding": (lambda: nn.Embedding(7, 4), lambda: IDS),
    "embedding_padding_idx": (lambda: nn.Embedding(7, 4, padding_idx=0), lambda: IDS),
    "layer_norm": (lambda: nn.LayerNorm(5), lambda: rand(B, 6, 5)),
    "layer_norm_2d_shape": (lambda: nn.LayerNorm((3, 5)), lambda: rand(B, 3, 5)),
    "layer_norm_flat_input": (lambda: nn.LayerNorm(5), lambda: rand(B, 5)),
    "layer_norm_nobias": (lambda: nn.LayerNorm(5, bias=False), lambda: rand(B, 6, 5)),
    "group_norm": (lambda: nn.GroupNorm(2, 4), lambda: rand(B, 4, 3, 3)),
    "rms_norm": (lambda: nn.RMSNorm(5, eps=1e-5), lambda: rand(B, 6, 5)),
    "rms_norm_eps_none": (lambda: nn.RMSNorm(5), lambda: rand(B, 6, 5)),
    "llama_rms_norm": (_llama_rms_norm, lambda: rand(B, 6, 5)),
    "gemma_rms_norm": (_gemma_rms_norm, lambda: rand(B, 6, 5)),
    "hf_conv1d": (_hf_conv1d, lambda: rand(B, 6, 5)),
    "hf_conv1d_2d": (_hf_conv1d, lambda: rand(B, 5)),
}


@pytest.mark.parametrize("clipping", ENGINES)
@pytest.mark.parametrize("case", sorted(LAYER_CASES))
def test_layer_matches_oracle(case: str, clipping: str) -> None:
    make_layer, make_input = LAYER_CASES[case]
    check_against_oracle(randomise(make_layer()), (make_input(),), clipping)


@pytest.mark.parametrize("clipping", ENGINES)
def test_mlp_with_inplace_activation(clipping: str) -> None:
    model = randomise(nn.Sequential(nn.Linear(5, 8), nn.ReLU(inplace=True), nn.Linear(8, 3), nn.Tanh()))
    check_against_oracle(model, (rand(B, 6, 5),), clipping)
    # in place on a 3-D Linear output (a view of the 2-D matmul result)
    model = randomise(
        nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.ReLU(inplace=True), nn.Linear(8, 3))
    )
    check_against_oracle(model, (rand(B, 6, 5),), clipping)


@pytest.mark.parametrize("clipping", ENGINES)
def test_frozen_parameters_are_skipped(clipping: str) -> None:
    model = randomise(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3), nn.LayerNorm(3)))
    model[0].weight.requires_grad_(False)
    model[2].requires_grad_(False)
    clipper = check_against_oracle(model, (rand(B, 6, 5),), clipping)
    assert clipper.trainable_parameters == [model[0].bias, model[3].weight, model[3].bias]
    assert model[0].weight.grad is None and model[2].weight.grad is None


class CalledTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.conv = nn.Conv1d(5, 5, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(torch.tanh(self.lin(x)))
        return self.conv(self.conv(h.transpose(1, 2)).tanh())


@pytest.mark.parametrize("clipping", ENGINES)
def test_tied_embedding_and_output_weight(clipping: str) -> None:
    model = randomise(TiedLM())
    assert model.out.weight is model.emb.weight
    check_against_oracle(model, (IDS,), clipping)


@pytest.mark.parametrize("clipping", ["flat", "mixed"])
def test_bookkeeping_reuses_materialised_gradients(clipping: str, monkeypatch) -> None:
    """Long sequences: the per-sample gradients are smaller than their factors (P Q <= T (P + Q)), so book-keeping
    forms the clipped sum from them and releases the captured tensors; the result is still the oracle's."""
    released = []
    release = Capture.release

    def recording_release(self: Capture) -> None:
        released.append(self.name)
        release(self)

    monkeypatch.setattr(Capture, "release", recording_release)
    seq = 64
    model = randomise(TiedLM(vocab=40, dim=6, seq=seq))
    ids = torch.randint(0, 40, (B, seq), generator=torch.Generator().manual_seed(3))
    check_against_oracle(model, (ids,), clipping)
    assert {"emb", "out", "mix"} <= set(released)


@pytest.mark.parametrize("clipping", ENGINES)
def test_module_called_twice(clipping: str) -> None:
    check_against_oracle(randomise(CalledTwice()), (rand(B, 6, 5),), clipping)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("clipping", ENGINES)
def test_tiny_gpt2_matches_oracle(clipping: str) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0
    )
    model = transformers.GPT2LMHeadModel(config).double()
    # Both projection paths: HF Conv1D (attention/MLP) and nn.Linear (lm_head, tied to the token embedding).
    assert isinstance(model.transformer.h[0].attn.c_attn, Conv1D)
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, 50, (3, 10), generator=torch.Generator().manual_seed(0))
    check_against_oracle(model, (ids,), clipping, loss_fn=lm_loss)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("clipping", ENGINES)
def test_tiny_llama_matches_oracle(clipping: str) -> None:
    """nn.Linear projections, HF LlamaRMSNorm (scale-only rule), rotary positions, tied embeddings."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        tie_word_embeddings=True,
    )
    model = randomise(transformers.LlamaForCausalLM(config), seed=3)
    ids = torch.randint(0, 50, (3, 10), generator=torch.Generator().manual_seed(0))
    # LlamaRMSNorm normalises in float32 even for a float64 model: absolute tolerance at float32 level.
    check_against_oracle(model, (ids,), clipping, loss_fn=lm_loss, atol=1e-5)


def test_gpt2_generate_and_save_pretrained_with_hooks(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16)
    model = transformers.GPT2LMHeadModel(config)
    keys = list(model.state_dict())
    clipper = PerSampleClipper(model, clipping="ghost", max_grad_norm=1.0)
    out = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 6)
    assert clipper._hooks.captures == []
    model.save_pretrained(tmp_path)
    reloaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)
    assert list(reloaded.state_dict()) == keys
    assert all(torch.equal(v, reloaded.state_dict()[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("clipping", ENGINES)
def test_bf16_autocast_norms_in_float32(clipping: str) -> None:
    model = nn.Sequential(nn.Linear(5, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))
    torch.manual_seed(0)
    x = torch.randn(B, 6, 5)
    grads = oracle_grads(model, (x,))
    clipper = PerSampleClipper(model, clipping=clipping, max_grad_norm=1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = sin_loss(model, (x,))
    assert loss.dtype == torch.bfloat16
    norms = clipper.backward(loss)
    assert norms.dtype == torch.float32
    torch.testing.assert_close(norms, oracle_norms(grads), rtol=5e-2, atol=0.0)
    assert all(p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("clipping", ENGINES)
def test_cuda_tied_lm(clipping: str) -> None:
    model = randomise(TiedLM()).cuda()
    check_against_oracle(model, (IDS.cuda(),), clipping)


@pytest.mark.parametrize("clipping", ENGINES)
def test_gradient_accumulation_sums(clipping: str) -> None:
    model = randomise(nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)))
    x1, x2 = rand(B, 5, seed=1), rand(3, 5, seed=2)
    grads = [oracle_grads(model, (x,)) for x in (x1, x2)]
    clipper = PerSampleClipper(model, clipping=clipping, max_grad_norm=0.5)
    clipper.backward(sin_loss(model, (x1,)))
    clipper.backward(sin_loss(model, (x2,)))
    for name, p in model.named_parameters():
        expected = 0
        for g in grads:
            factors = (0.5 / (oracle_norms(g) + 1e-6)).clamp(max=1.0)
            expected = expected + torch.einsum("b,b...->...", factors, g[name])
        torch.testing.assert_close(p.grad, expected, rtol=RTOL, atol=1e-10)


@pytest.mark.parametrize("clipping", ENGINES)
def test_empty_batch(clipping: str) -> None:
    model = randomise(nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 2)))
    model[2].bias.grad = torch.ones_like(model[2].bias)
    clipper = PerSampleClipper(model, clipping=clipping, max_grad_norm=1.0)
    norms = clipper.backward(sin_loss(model, (rand(0, 5),)))
    assert norms.shape == (0,)
    for p in clipper.trainable_parameters:
        expected = torch.ones_like(p) if p is model[2].bias else torch.zeros_like(p)
        assert torch.equal(p.grad, expected)
    clipper.backward(sin_loss(model, (rand(B, 5),)))  # the next batch still works


@pytest.mark.parametrize("clipping", ENGINES)
def test_small_cnn(clipping: str) -> None:
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.GroupNorm(2, 4),
        nn.ReLU(inplace=True),
        nn.Conv2d(4, 4, 3, stride=2, groups=2),
        nn.Flatten(),
        nn.Linear(4 * 3 * 3, 3),
    )
    check_against_oracle(randomise(model), (rand(B, 3, 8, 8),), clipping)


def test_l1_clipping_flat() -> None:
    model = randomise(nn.Sequential(nn.Conv1d(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 6, 3)))
    check_against_oracle(model, (rand(B, 3, 8),), "flat", norm=1)
    check_against_oracle(randomise(TiedLM()), (IDS,), "flat", norm=1)


def test_detach_restores_module() -> None:
    model = randomise(TiedLM())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    hook_attrs = [name for name in vars(nn.Module()) if "hooks" in name]

    def hooks() -> list[dict]:
        return [{a: dict(getattr(m, a)) for a in hook_attrs} for m in model.modules()]

    before = hooks()
    clipper = PerSampleClipper(model, clipping="ghost", max_grad_norm=1.0)
    assert hooks() != before
    assert list(model.state_dict()) == list(state)
    clipper.backward(sin_loss(model, (IDS,)))
    clipper.detach()
    assert hooks() == before
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert list(model.state_dict()) == list(state)
    with pytest.raises(RuntimeError, match="detached"):
        clipper.backward(sin_loss(model, (IDS,)))


def test_stale_forward_does_not_leak_into_next_batch() -> None:
    model = randomise(TiedLM())
    ids = IDS[[0, 2]]
    grads = oracle_grads(model, (ids,))
    clipper = PerSampleClipper(model, clipping="ghost", max_grad_norm=1.0)
    model(IDS[:3])  # recorded but never clipped (e.g. a forward outside the training step)
    torch.testing.assert_close(
        clipper.per_sample_norms(sin_loss(model, (ids,))), oracle_norms(grads), rtol=RTOL, atol=0
    )


def test_no_grad_forward_records_nothing() -> None:
    model = randomise(TiedLM())
    clipper = PerSampleClipper(model, clipping="ghost", max_grad_norm=1.0)
    with torch.no_grad():
        model(IDS)
    assert clipper._hooks.captures == []


def test_batchnorm_rejected() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Sequential(nn.BatchNorm2d(4)))
    model[1][0].requires_grad_(False)
    with pytest.raises(UnsupportedModuleError, match=r"'1\.0'.*GroupNorm"):
        PerSampleClipper(model, max_grad_norm=1.0)


def test_a_module_of_its_own_parameters_needs_an_fsdp2_free_rerun() -> None:
    """The fallback's refusals at attach: only under FSDP2 (clipping/layers/fallback.py:fallback_problem)."""
    block = nn.Sequential(nn.Linear(3, 3))
    block.scale = nn.Parameter(torch.ones(3))
    assert fallback_problem(block, sharded=False) is None
    assert "submodules' parameters" in str(fallback_problem(block, sharded=True))


class UsesChildWeight(nn.Module):
    """Uses a child layer's weight functionally without calling the child (as nn.MultiheadAttention does with
    out_proj, which the clipper now swaps)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.proj.weight, self.proj.bias)


def test_parameter_used_outside_its_forward_rejected() -> None:
    model = UsesChildWeight()
    clipper = PerSampleClipper(model, max_grad_norm=1.0)  # proj is an nn.Linear ...
    with pytest.raises(UnsupportedModuleError, match="proj"):  # ... but its weight is used functionally
        clipper.backward(model(torch.randn(3, 4)).sum(1))


@pytest.mark.parametrize("clipping", ENGINES)
def test_hooked_parameter_also_used_functionally_rejected(clipping: str) -> None:
    model = FunctionalReuse()
    clipper = PerSampleClipper(model, clipping=clipping, max_grad_norm=1.0)
    with pytest.raises(UnsupportedModuleError, match=r"'lin\.weight'.*outside the forward"):
        clipper.backward(sin_loss(model, (torch.randn(B, 5),)))


class DetachedReuse(FunctionalReuse):
    """FunctionalReuse whose functional use of the weight carries no gradient: the oracle of the hooked use alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + F.linear(x.flip(-1), self.lin.weight.detach())


@pytest.mark.parametrize("clipping", ENGINES)
def test_bookkeeping_without_check_drops_outside_use(clipping: str) -> None:
    """Unchecked book-keeping: the functional use of lin.weight loses its gradient but never reaches .grad."""
    model = randomise(FunctionalReuse())
    oracle = DetachedReuse().double()
    oracle.load_state_dict(model.state_dict())
    x = rand(B, 5)
    grads = oracle_grads(oracle, (x,))
    factors = (1.0 / (oracle_norms(grads) + 1e-6)).clamp(max=1.0)
    unchecked = PerSampleClipper(model, clipping=clipping, max_grad_norm=1.0, sum_check_every=None)
    unchecked.backward(sin_loss(model, (x,)))
    named = dict(model.named_parameters())
    for name, per_sample in grads.items():
        torch.testing.assert_close(
            named[name].grad, torch.einsum("b,b...->...", factors, per_sample), rtol=RTOL, atol=0
        )


def test_embedding_scale_grad_by_freq_rejected() -> None:
    with pytest.raises(UnsupportedModuleError, match="scale_grad_by_freq"):
        PerSampleClipper(nn.Embedding(5, 2, scale_grad_by_freq=True), max_grad_norm=1.0)


@pytest.mark.parametrize("shape", [(), (B, 2)])
def test_non_per_sample_loss_rejected(shape: tuple[int, ...]) -> None:
    model = nn.Linear(5, 2)
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    out = model(torch.randn(B, 5))
    loss = out.sum() if shape == () else out
    with pytest.raises(ValueError, match=r"per-sample loss of shape \[B\]"):
        clipper.backward(loss)


def test_batch_mismatch_rejected() -> None:
    model = nn.Linear(5, 3)
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    loss = model(torch.randn(B, 5)).sum(0)  # shape [3], not [B]
    with pytest.raises(ValueError, match="batch dimension of 4"):
        clipper.backward(loss)
    folded = nn.Linear(5, 2)  # [2]: 4 rows could be 2 examples of 2 rows each, but nothing folds them
    with pytest.raises(UnsupportedModuleError, match="batch dimension of 4 but the per-sample loss has 2"):
        PerSampleClipper(folded, max_grad_norm=1.0).backward(folded(torch.randn(B, 5)).sum(0))


def test_argument_validation() -> None:
    model = nn.Linear(5, 2)
    with pytest.raises(ValueError, match="clipping='flat'"):
        PerSampleClipper(model, clipping="ghost", max_grad_norm=1.0, norm=1)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="max_grad_norm"):
            PerSampleClipper(model, max_grad_norm=bad)
    with pytest.raises(ValueError, match="Unknown clipping"):
        PerSampleClipper(model, clipping="nope", max_grad_norm=1.0)
    with pytest.raises(ValueError, match="norm must be"):
        PerSampleClipper(model, max_grad_norm=1.0, norm=3)


class L2Penalised(nn.Module):
    """Linear -> tanh -> Linear; the loss may add an L2 penalty on the first weight (a use outside its forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))

    def loss(self, x: torch.Tensor, lam: float) -> torch.Tensor:
        return self.net(x).sin().sum(1) + lam * (self.net[0].weight ** 2).sum()


@pytest.mark.parametrize("clipping", ENGINES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_outside_use_checked_on_every_batch(clipping: str, dtype: torch.dtype) -> None:
    """``sum_check_every=1``: an L2 penalty that is zero on the first batches and non-zero later raises at that batch,
    before anything is written."""
    torch.manual_seed(0)
    model = L2Penalised().to(dtype)
    clipper = PerSampleClipper(model, clipping=clipping, max_grad_norm=1.0, sum_check_every=1)
    x = torch.randn(B, 5, dtype=dtype)
    for _ in range(2):
        clipper.backward(model.loss(x, lam=0.0))
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    with pytest.raises(UnsupportedModuleError, match=r"'net\.0\.weight'.*outside the forward.*weight_decay"):
        clipper.backward(model.loss(x, lam=0.5))
    assert all(torch.equal(p.grad, before[n]) for n, p in model.named_parameters()), "nothing written on error"
    assert clipper._hooks.captures == []
    # A small penalty (lam=1e-3) is still caught in float32/64.
    with pytest.raises(UnsupportedModuleError, match=r"'net\.0\.weight'"):
        clipper.backward(model.loss(x, lam=1e-3))


@pytest.mark.parametrize("clipping", ENGINES)
def test_bookkeeping_checks_on_schedule(clipping: str) -> None:
    """Book-keeping: the check runs on the first batch and then every ``sum_check_every`` batches."""
    torch.manual_seed(0)
    model = L2Penalised().double()
    x = torch.randn(B, 5, dtype=torch.float64)
    with pytest.raises(UnsupportedModuleError, match=r"'net\.0\.weight'"):
        PerSampleClipper(model, clipping=clipping, max_grad_norm=1.0).backward(model.loss(x, lam=0.5))
    clipper = PerSampleClipper(model, clipping=clipping, max_grad_norm=1.0, sum_check_every=3)
    clipper.backward(model.loss(x, lam=0.0))  # batch 0: checked, passes
    for _ in range(2):  # batches 1, 2: unchecked, the penalty's gradient is dropped
        clipper.backward(model.loss(x, lam=0.5))
    with pytest.raises(UnsupportedModuleError, match=r"'net\.0\.weight'"):
        clipper.backward(model.loss(x, lam=0.5))  # batch 3: checked


@pytest.mark.parametrize("clipping", ENGINES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zero_gradient_parameter_passes_check(clipping: str, dtype: torch.dtype) -> None:
    """Conv1d before GroupNorm(C, C): the conv bias has an exactly-zero gradient, rounding noise must not raise."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(3, 4, 3), nn.GroupNorm(4, 4), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 6, 2))
    model = model.to(dtype)
    clipper = PerSampleClipper(model, clipping=clipping, max_grad_norm=1.0)
    for seed in range(3):
        x = torch.randn(8, 3, 8, generator=torch.Generator().manual_seed(seed), dtype=dtype)
        clipper.backward(sin_loss(model, (x,)))
    assert model[0].bias.grad.abs().max() < 1e-5


def test_extra_parameter_of_supported_subclass_rejected() -> None:
    """A parameter of a hooked layer that its family does not cover, used outside, never reaches .grad unclipped."""

    class GainLinear(nn.Linear):  # inherits Linear.forward, so it is hooked as a Linear
        def __init__(self) -> None:
            super().__init__(5, 3)
            self.gain = nn.Parameter(torch.ones(3))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = GainLinear()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.lin.gain

    model = Model()
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    with pytest.raises(UnsupportedModuleError, match=r"'lin\.gain'.*no per-sample gradient"):
        clipper.backward(sin_loss(model, (torch.randn(B, 5),)))
    assert all(p.grad is None for p in model.parameters())
    # Unchecked book-keeping: the gain gets no gradient (zeros, then noise), never an unclipped one.
    model = Model()
    PerSampleClipper(model, max_grad_norm=1.0, sum_check_every=None).backward(sin_loss(model, (torch.randn(B, 5),)))
    assert torch.equal(model.lin.gain.grad, torch.zeros(3))


def _two_layer() -> nn.Sequential:
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def test_freeze_after_attach_rejected() -> None:
    model = _two_layer()
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    clipper.backward(sin_loss(model, (torch.randn(B, 5),)))
    model[0].requires_grad_(False)  # e.g. BackboneFinetuning freezing the backbone in a hook
    with pytest.raises(ValueError, match=r"no longer trainable.*'0\.weight', '0\.bias'.*fixed before fit"):
        clipper.backward(sin_loss(model, (torch.randn(B, 5),)))
    with pytest.raises(ValueError, match="no longer trainable"):
        clipper.per_sample_norms(sin_loss(model, (torch.randn(0, 5),)))
    model[0].requires_grad_(True)  # restoring the original set is fine
    clipper.backward(sin_loss(model, (torch.randn(B, 5),)))


def test_unfreeze_after_attach_rejected() -> None:
    model = _two_layer()
    model[0].requires_grad_(False)
    clipper = PerSampleClipper(model, max_grad_norm=1.0)
    model[0].weight.requires_grad_(True)  # would otherwise get noise-only updates
    with pytest.raises(ValueError, match=r"newly trainable.*'0\.weight'.*create a new clipper"):
        clipper.backward(sin_loss(model, (torch.randn(B, 5),)))
    assert model[0].weight.grad is None and model[2].weight.grad is None


@pytest.mark.parametrize(
    "make",
    [
        lambda: nn.InstanceNorm1d(4, track_running_stats=True),
        lambda: nn.InstanceNorm2d(4, affine=True, track_running_stats=True),
    ],
)
def test_instance_norm_with_running_stats_rejected(make: Callable[[], nn.Module]) -> None:
    model = nn.Sequential(nn.Conv1d(3, 4, 3), nn.Sequential(make()))
    with pytest.raises(UnsupportedModuleError, match=r"'1\.0'.*track_running_stats=True.*GroupNorm"):
        PerSampleClipper(model, max_grad_norm=1.0)


def test_instance_norm_without_running_stats_accepted() -> None:
    model = randomise(nn.Sequential(nn.Conv1d(3, 4, 3), nn.InstanceNorm1d(4), nn.Flatten(), nn.Linear(4 * 6, 2)))
    check_against_oracle(model, (rand(B, 3, 8),), "ghost")


class InputChangedAfterwards(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        x.mul_(10.0)  # changes the activation the per-sample gradient of lin.weight needs
        return h


def test_input_modified_in_place_after_the_layer_rejected() -> None:
    """Book-keeping never runs the layer's backward node, so autograd's own version check cannot catch this."""
    model = InputChangedAfterwards()
    clipper = PerSampleClipper(model, clipping="ghost", max_grad_norm=1.0, sum_check_every=None)
    with pytest.raises(ValueError, match="modified in place after the module ran"):
        clipper.backward(sin_loss(model, (torch.randn(B, 5),)))


class WideThenSliced(nn.Linear):
    """A registered layer whose output is a strided view (not a reshape) of a larger tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return torch.cat([out, out], dim=-1)[..., : self.out_features]


def test_view_output_that_is_not_a_reshape_is_copied() -> None:
    from lightning_dp.clipping import register_layer
    from lightning_dp.clipping.layers.linear import linear_terms

    register_layer(WideThenSliced)(linear_terms)
    model = randomise(nn.Sequential(WideThenSliced(5, 4), nn.ReLU(inplace=True), nn.Linear(4, 2)))
    assert model[0](rand(B, 6, 5))._base is not None
    check_against_oracle(model, (rand(B, 6, 5),), "ghost")


@pytest.mark.parametrize("clipping", ["flat", "ghost", "mixed"])
def test_a_forward_hook_that_replaces_a_layers_output(clipping: str) -> None:
    """A user's forward hook (registered before the clipper) returning a new output: the per-sample gradients are
    those of the layer's own output, taken before the hook (the clipper's hook runs first)."""
    model = randomise(nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)))
    model[0].register_forward_hook(lambda module, args, output: 2.0 * output + 0.5)
    check_against_oracle(model, (rand(B, 6, 5),), clipping)
