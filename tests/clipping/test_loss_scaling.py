"""The clipper's fixed loss scale under float16 autocast (lightning_dp/clipping/loss_scaling.py, docs/privacy.md
"Mixed precision"): per-sample norms and the clipped sum in unscaled float32 units against the float32 per-example
oracle, and an example whose scaled gradient overflows float16 dropped while the others' clipped sum is unchanged.
"""

from __future__ import annotations

import pytest
import torch
from clipping_helpers import ENGINES, expected_sum, oracle_grads, oracle_norms, sin_loss
from torch import nn

from lightning_dp.clipping import PerSampleClipper
from lightning_dp.clipping.loss_scaling import FP16_LOSS_SCALE, unscale_linear, unscale_norms, validate_loss_scale

B = 6
#: float16 keeps 11 significant bits (unit roundoff 2^-11 ~ 4.9e-4); the captures, products and reductions of a
#: two-layer model stay within this relative error of the float32 oracle.
FP16_RTOL = 2e-2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 3))


def _params_close(model: nn.Module, expected: dict[str, torch.Tensor], rtol: float) -> None:
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all()
        scale = expected[name].norm().item()
        torch.testing.assert_close(p.grad, expected[name], rtol=rtol, atol=rtol * scale)


@pytest.mark.parametrize("clipping", ENGINES)
def test_fp16_autocast_norms_and_clipped_sum_match_the_float32_oracle(clipping: str) -> None:
    model = _model()
    x = torch.randn(B, 4, 5)
    grads = oracle_grads(model, (x,))
    reference = oracle_norms(grads)
    bound = float(reference.median())
    clipper = PerSampleClipper(model, clipping=clipping, max_grad_norm=bound)
    clipper.loss_scale = FP16_LOSS_SCALE
    with torch.autocast("cpu", dtype=torch.float16):
        loss = sin_loss(model, (x,))
    norms = clipper.backward(loss)
    assert norms.dtype == torch.float32
    torch.testing.assert_close(norms, reference, rtol=FP16_RTOL, atol=0.0)
    expected = expected_sum(grads, dict.fromkeys(grads, 0), [bound])
    _params_close(model, expected, FP16_RTOL)
    assert not clipper.dropped_nonfinite


@pytest.mark.parametrize("clipping", ENGINES)
def test_the_scale_is_undone_exactly_in_float32(clipping: str) -> None:
    """Without autocast the scaled backward gives the unscaled run's norms and clipped sum (a power of two)."""
    x = torch.randn(B, 4, 5)
    results = []
    for scale in (1.0, FP16_LOSS_SCALE):
        model = _model()
        clipper = PerSampleClipper(model, clipping=clipping, max_grad_norm=0.3)
        clipper.loss_scale = scale
        norms = clipper.backward(sin_loss(model, (x,)))
        results.append((norms, [p.grad.clone() for p in model.parameters()]))
    (norms_1, grads_1), (norms_s, grads_s) = results
    torch.testing.assert_close(norms_s, norms_1, rtol=1e-6, atol=0.0)
    for a, b in zip(grads_s, grads_1, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _temperature_loss(model: nn.Module, x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``[B]``: ``t_i sum(out_i)`` in float32 from the float16 output (finite for ``t_i = 1e4``), whose output gradient
    ``S t_i`` overflows float16 at ``S = 2^8`` for ``t_i = 1e4`` (2.56e6 > 65504) but not unscaled."""
    return model(x).float().flatten(1).sum(1) * temperature


@pytest.mark.parametrize("clipping", ENGINES)
def test_an_example_overflowing_under_the_scale_is_dropped_and_the_others_kept(clipping: str) -> None:
    model = _model()
    x = torch.randn(B, 5)
    temperature = torch.ones(B)
    temperature[2] = 1e4
    grads = oracle_grads(model, (x, temperature), lambda f, xs: f(xs[0]).flatten(1).sum(1) * xs[1])
    keep = torch.ones(B)
    keep[2] = 0
    clipper = PerSampleClipper(model, clipping=clipping, max_grad_norm=0.5)
    clipper.loss_scale = FP16_LOSS_SCALE
    with torch.autocast("cpu", dtype=torch.float16):
        loss = _temperature_loss(model, x, temperature)
    assert torch.isfinite(loss).all()
    norms = clipper.backward(loss)
    assert not torch.isfinite(norms[2]) and torch.isfinite(norms[keep.bool()]).all()
    assert clipper.dropped_nonfinite
    _params_close(model, expected_sum(grads, dict.fromkeys(grads, 0), [0.5], keep=keep), FP16_RTOL)


def test_validation_and_unscaling() -> None:
    assert validate_loss_scale(256) == 256.0
    for bad in (0, -2.0, 3.0, float("inf"), True):
        with pytest.raises(ValueError, match="power of two"):
            validate_loss_scale(bad)  # type: ignore[arg-type]
    clipper = PerSampleClipper(_model(), max_grad_norm=1.0)
    with pytest.raises(ValueError, match="power of two"):
        clipper.loss_scale = 100.0
    totals = torch.tensor([[16.0, 4.0]])
    assert torch.equal(unscale_norms(totals, 4.0, 2), torch.tensor([[1.0, 0.25]]))
    assert torch.equal(unscale_norms(totals, 4.0, 1), torch.tensor([[4.0, 1.0]]))
    assert torch.equal(unscale_linear(totals, 4.0), torch.tensor([[4.0, 1.0]]))


def test_a_sum_check_whose_float16_batch_gradient_overflows_does_not_fail() -> None:
    """Each example's scaled output gradient (256 * 200 = 51200) fits float16, autograd's batch weight gradient (the
    sum over 8 examples) does not: the sum check's tolerance is then infinite (vacuous, as for any overflowing batch
    gradient: postponing it would let one example move the check schedule), so nothing is raised or dropped."""
    torch.manual_seed(0)
    model = nn.Linear(5, 1)
    clipper = PerSampleClipper(model, max_grad_norm=1.0, sum_check_every=1)
    clipper.loss_scale = FP16_LOSS_SCALE
    for temperature in (200.0, 1.0):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.ones(8, 5)).float().squeeze(-1) * temperature
        norms = clipper.backward(loss)
        assert torch.isfinite(norms).all() and not clipper.dropped_nonfinite and not clipper.sum_check_postponed
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
