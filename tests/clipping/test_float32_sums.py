"""16-bit trainable parameters (``bf16-true``, a model loaded in half precision) keep their clipped sum in float32,
get the noise added and the division by ``q N`` in float32, and are cast only at the end
(lightning_dp/clipping/float32_sums.py, docs/privacy.md "Mixed precision").
"""

from __future__ import annotations

import logging

import pytest
import torch
from clipping_helpers import expected_sum, oracle_grads, oracle_norms, sin_loss
from torch import nn

from lightning_dp.clipping import PerSampleClipper
from lightning_dp.clipping.float32_sums import float32_sum, take_float32_sums
from lightning_dp.mechanisms import make_mechanism
from lightning_dp.optim import DPOptimizer, DPRandomness

B = 6
#: bfloat16 keeps 8 significant bits (unit roundoff 2^-8): the per-example gradients of the bf16 model, and hence its
#: norms and clipped sum, are within this relative error of the float32 oracle on the same (bf16-valued) weights.
BF16_RTOL = 6e-2


def _models(dtype: torch.dtype) -> tuple[nn.Module, nn.Module]:
    """The model in ``dtype`` and its float32 copy with the same (``dtype``-rounded) values."""
    torch.manual_seed(0)
    low = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)
    wide = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))
    wide.load_state_dict({k: v.float() for k, v in low.state_dict().items()})
    return low, wide


def _optimizer(model: nn.Module, seed: int = 0) -> DPOptimizer:
    return DPOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0),
        mechanism=make_mechanism("gaussian", max_grad_norm=1.0, noise_multiplier=1.0),
        expected_batch_size=4.0,
        randomness=DPRandomness(seed),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_clipped_sum_of_16_bit_parameters_is_float32_and_matches_the_oracle(dtype: torch.dtype) -> None:
    low, wide = _models(dtype)
    x = torch.randn(B, 5)
    grads = oracle_grads(wide, (x,))
    bound = float(oracle_norms(grads).median())
    clipper = PerSampleClipper(low, max_grad_norm=bound)
    norms = clipper.backward(sin_loss(low, (x.to(dtype),)).float())
    torch.testing.assert_close(norms, oracle_norms(grads), rtol=BF16_RTOL, atol=0.0)
    expected = expected_sum(grads, dict.fromkeys(grads, 0), [bound])
    sums = take_float32_sums(list(low.parameters()))
    for (name, p), total in zip(low.named_parameters(), sums, strict=True):
        assert p.grad.dtype == dtype and not p.grad.any()  # the sum is kept beside .grad, not rounded into it
        assert total is not None and total.dtype == torch.float32
        scale = expected[name].norm().item()
        torch.testing.assert_close(total, expected[name], rtol=BF16_RTOL, atol=BF16_RTOL * scale)


def test_noise_is_added_in_float32_and_cast_at_the_end() -> None:
    """Two micro-batches accumulate in float32; privatise gives exactly ``((sum + noise) / qN).to(bf16)`` with the
    noise drawn in float32 (not quantised to bf16 before the addition)."""
    low, _ = _models(torch.bfloat16)
    clipper = PerSampleClipper(low, max_grad_norm=0.5)
    for seed in (1, 2):
        x = torch.randn(B, 5, generator=torch.Generator().manual_seed(seed)).bfloat16()
        clipper.backward(sin_loss(low, (x,)).float())
    params = list(low.parameters())
    sums = [float32_sum(p).clone() for p in params]
    optimizer = _optimizer(low, seed=5)
    optimizer.privatise()
    mechanism, randomness = optimizer.mechanism, DPRandomness(5)
    for p, total in zip(params, sums, strict=True):
        noise = mechanism.sample(total, randomness.noise_generator(total.device))
        assert noise.dtype == torch.float32
        assert torch.equal(p.grad, ((total + noise) / 4.0).to(torch.bfloat16))
    assert all(float32_sum(p) is None for p in params)  # consumed


def test_a_new_step_starts_a_new_sum_and_zero_grad_discards() -> None:
    low, _ = _models(torch.bfloat16)
    clipper = PerSampleClipper(low, max_grad_norm=0.5)
    x = torch.randn(B, 5).bfloat16()
    clipper.backward(sin_loss(low, (x,)).float())
    first = [float32_sum(p).clone() for p in low.parameters()]
    optimizer = _optimizer(low)
    optimizer.zero_grad()  # a skipped step: the sum is dropped with the gradients
    assert all(float32_sum(p) is None for p in low.parameters())
    clipper.backward(sin_loss(low, (x,)).float())
    for p, total in zip(low.parameters(), first, strict=True):
        assert torch.equal(float32_sum(p), total)
    low.zero_grad()  # set_to_none (the HF Trainer's model.zero_grad): the next clip starts afresh
    clipper.backward(sin_loss(low, (x,)).float())
    for p, total in zip(low.parameters(), first, strict=True):
        assert torch.equal(float32_sum(p), total)
    optimizer.zero_grad()


def test_float32_parameters_are_untouched_and_16_bit_ones_not_warned_about(caplog) -> None:
    model = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 1).bfloat16())
    with caplog.at_level(logging.WARNING, logger="lightning_dp"):
        clipper = PerSampleClipper(model, max_grad_norm=1.0)
    assert not [r for r in caplog.records if "rounded to that dtype" in r.getMessage()]
    x = torch.randn(B, 5)
    clipper.backward(model[1](model[0](x).bfloat16()).float().squeeze(-1))
    assert float32_sum(model[0].weight) is None and model[0].weight.grad.any()
    assert float32_sum(model[1].weight) is not None and not model[1].weight.grad.any()
    _optimizer(model).zero_grad()
