"""Scaled weight standardisation (lightning_dp.WSConv2d): the layer against De et al.'s fused formula, and its
per-sample gradients (every exact engine) against the torch.func oracle,
including grouped convolutions, rows on the variance floor, a frozen gain and a Wide-ResNet that uses it."""

from __future__ import annotations

import copy

import pytest
import torch
from clipping_helpers import (
    ENGINES,
    check_against_oracle,
    oracle_grads,
    oracle_norms,
    rand,
    randomise,
    sin_loss,
)
from torch import nn

from lightning_dp import WSConv2d
from lightning_dp.clipping import PerSampleClipper, UnsupportedModuleError
from lightning_dp.recipes.wide_resnet import WideResNet

B = 3


def fused_reference(weight: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    """jax_privacy's / nfnets' ``standardize_weight`` for an OIHW weight: ``weight * scale - mean * scale`` with
    ``scale = rsqrt(max(var * fan_in, eps)) * gain``."""
    mean = weight.mean(dim=(1, 2, 3), keepdim=True)
    var = weight.var(dim=(1, 2, 3), unbiased=False, keepdim=True)
    fan_in = weight[0].numel()
    scale = torch.rsqrt((var * fan_in).clamp_min(eps)) * gain.view(-1, 1, 1, 1)
    return weight * scale - mean * scale


def test_standardised_weight_is_de_et_al_formula_and_the_forward_uses_it() -> None:
    layer = randomise(WSConv2d(3, 4, 3, stride=2, padding=1))
    layer.weight.data[1] = 0.25  # a constant row: N var = 0 < eps, the floor is active
    expected = fused_reference(layer.weight, layer.gain, layer.eps)
    torch.testing.assert_close(layer.standardised_weight(), expected)
    rows = layer.standardised_weight().flatten(1)
    active = [0, 2, 3]
    torch.testing.assert_close(rows[active].sum(1), torch.zeros(3, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(rows[active].norm(dim=1), layer.gain[active].abs().detach())
    x = rand(B, 3, 5, 5)
    conv = nn.functional.conv2d(x, expected, layer.bias, stride=2, padding=1)
    torch.testing.assert_close(layer(x), conv)


def test_defaults_follow_de_et_al() -> None:
    layer = WSConv2d(2, 3, 3)
    assert layer.eps == 1e-4 and layer.bias is not None
    assert torch.equal(layer.gain.detach(), torch.ones(3))
    assert "eps=0.0001" in repr(layer)
    for eps in (0.0, float("inf")):
        with pytest.raises(ValueError, match="eps must be positive and finite"):
            WSConv2d(2, 3, 3, eps=eps)
    with torch.no_grad():
        layer.gain.mul_(3.0)
    layer.reset_parameters()
    assert torch.equal(layer.gain.detach(), torch.ones(3))


CASES = {
    "plain": lambda: WSConv2d(3, 4, 3, padding=1),
    "strided_dilated_reflect": lambda: WSConv2d(2, 3, (3, 2), stride=(2, 1), padding=2, dilation=(1, 2),
                                                padding_mode="reflect"),
    "groups": lambda: WSConv2d(4, 6, 3, groups=2, padding=1),
    "no_bias_1x1": lambda: WSConv2d(3, 5, 1, bias=False),
}  # fmt: skip
INPUT_CHANNELS = {"plain": 3, "strided_dilated_reflect": 2, "groups": 4, "no_bias_1x1": 3}


@pytest.mark.parametrize("clipping", ENGINES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_per_sample_gradients_match_the_oracle(case: str, clipping: str) -> None:
    layer = randomise(CASES[case]())
    check_against_oracle(layer, (rand(B, INPUT_CHANNELS[case], 6, 5),), clipping)


@pytest.mark.parametrize("clipping", ENGINES)
@pytest.mark.parametrize("groups", [1, 2])
def test_rows_on_the_variance_floor_match_the_oracle(clipping: str, groups: int) -> None:
    """A row whose ``N var`` is below ``eps`` has no normalisation by its norm: its Jacobian is only the centring."""
    layer = randomise(WSConv2d(4, 4, 2, groups=groups, eps=1e-2))
    with torch.no_grad():
        layer.weight[1] = 0.3 + 1e-3 * rand(*layer.weight.shape[1:], seed=5)  # N var ~ 1e-5 < eps
    assert (layer.weight[1].var(unbiased=False) * layer.weight[1].numel()) < layer.eps
    check_against_oracle(layer, (rand(B, 4, 4, 4),), clipping)


@pytest.mark.parametrize("clipping", ENGINES)
def test_frozen_gain_or_weight(clipping: str) -> None:
    layer = randomise(WSConv2d(3, 4, 3))
    layer.gain.requires_grad_(False)
    check_against_oracle(layer, (rand(B, 3, 5, 5),), clipping)
    layer = randomise(WSConv2d(3, 4, 3))
    layer.weight.requires_grad_(False)
    check_against_oracle(layer, (rand(B, 3, 5, 5),), clipping)


@pytest.mark.parametrize("clipping", ENGINES)
def test_wide_resnet_with_weight_standardisation_matches_the_oracle(clipping: str) -> None:
    model = WideResNet(depth=10, width=1, groups=4, weight_standardisation=True)
    assert sum(isinstance(m, WSConv2d) for m in model.modules()) == 1 + 3 * 2 + 3  # stem, 2 per block, shortcuts
    assert not any(type(m) is nn.Conv2d for m in model.modules())
    check_against_oracle(randomise(model), (rand(2, 3, 8, 8),), clipping)


@pytest.mark.parametrize("clipping", ENGINES)
def test_per_sample_momentum_pulls_each_iterate_back_through_its_own_weights(clipping: str) -> None:
    """A past iterate's terms are built at the next clip, after the weights moved on: the family must use the
    weights that iterate's forward used (copied by the hook), or the momentum's per-sample norms are wrong."""

    def make() -> nn.Module:
        return nn.Sequential(WSConv2d(3, 4, 3), nn.Tanh(), WSConv2d(4, 2, 3, groups=2))

    now, past = randomise(make(), seed=0), randomise(make(), seed=1)
    x = rand(B, 3, 6, 6)
    g_now, g_past = oracle_grads(now, (x,)), oracle_grads(past, (x,))
    w_now, w_past = 0.6, 0.4
    momentum = {k: w_now * g_now[k] + w_past * g_past[k] for k in g_now}
    model = copy.deepcopy(past)
    clipper = PerSampleClipper(model, clipping=clipping, max_grad_norm=1e9)
    clipper.add_past_iterate(sin_loss(model, (x,)), w_past)
    with torch.no_grad():
        for p, q in zip(model.parameters(), now.parameters(), strict=True):
            p.copy_(q)
    norms = clipper.backward(sin_loss(model, (x,)), weight=w_now)
    torch.testing.assert_close(norms, oracle_norms(momentum), rtol=1e-9, atol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, momentum[name].sum(0), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("clipping", ENGINES)
def test_float32_gradient_along_the_weight_row_is_not_lost(clipping: str) -> None:
    """In float32, a sample whose gradient with respect to the standardised weight is nearly parallel to the weight
    row has a small true norm (the standardisation removes that direction) but large parts that cancel; the norm
    must come out right, never near zero while the sample's clipped contribution is not (a privacy failure a
    difference of squared norms, as ghost clipping of a factored form takes, produced here)."""
    channels, size = 16, 8
    layer = WSConv2d(channels, 1, 1, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(1, channels, 1, 1, generator=torch.Generator().manual_seed(3)))
    layer.gain.requires_grad_(False)
    row = (layer.weight - layer.weight.mean()).reshape(channels).detach()
    noise = torch.randn(1, channels, size, size, generator=torch.Generator().manual_seed(103))
    x = 40 * (10 * row.view(1, channels, 1, 1).expand(1, channels, size, size) + 1e-2 * noise)

    def loss(module: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return module(*inputs).flatten(1).sum(1)

    true = oracle_norms(oracle_grads(copy.deepcopy(layer).double(), (x.double(),), loss))
    clipper = PerSampleClipper(layer, clipping=clipping, max_grad_norm=1.0, sum_check_every=None)
    norms = clipper.backward(loss(layer, (x,)))
    torch.testing.assert_close(norms.double(), true, rtol=1e-3, atol=0)
    assert layer.weight.grad.norm() <= 1.0 + 1e-5  # the clipped contribution is within C


@pytest.mark.parametrize("big", [1e5, 1e6, 1e7, 1e8])
def test_an_input_along_the_weight_row_raises_nothing(big: float) -> None:
    """The reproduction of a membership-revealing raise: float32, only the WSConv2d weight trainable (gain, bias and
    head frozen), one input ``x = big * (w_r - mean(w_r))``. Its gradient with respect to the standardised weight
    is along the row, so the pull-back cancels magnitudes of order ``big``, and the sum check compared their float32
    rounding with a tolerance scaled by the (small) batch sum: it raised exactly when the example was in the batch.
    The tolerance now covers the rounding of what cancelled: both batches train. The clipped sums differ by at most
    ``C``."""
    torch.manual_seed(0)
    conv = WSConv2d(3, 1, 3)
    head = nn.Linear(1, 2)
    model = nn.Sequential(conv, nn.Flatten(), head)
    for param in (conv.gain, conv.bias, *head.parameters()):
        param.requires_grad_(False)
    ordinary = torch.randn(6, 3, 3, 3)
    row = conv.weight.detach()[0]
    crafted = torch.cat([ordinary, big * (row - row.mean())[None]])
    sums = []
    for x in (ordinary, crafted):
        clipper = PerSampleClipper(copy.deepcopy(model), clipping="flat", max_grad_norm=1.0)
        labels = torch.arange(x.shape[0]) % 2
        clipper.backward(nn.functional.cross_entropy(clipper.module(x), labels, reduction="none"))
        assert not clipper.dropped_nonfinite
        sums.append(clipper.module[0].weight.grad)
    assert float((sums[1] - sums[0]).norm()) <= 1.0 + 1e-5


def test_a_subclass_with_another_standardisation_is_refused() -> None:
    class Centred(WSConv2d):
        def standardised_weight(self) -> torch.Tensor:
            return self.weight - self.weight.mean()

    with pytest.raises(UnsupportedModuleError, match="overrides WSConv2d.standardised_weight"):
        PerSampleClipper(nn.Sequential(Centred(2, 3, 3)), max_grad_norm=1.0)
