"""The rows of a factored term that count (``clipping/rows.py``, docs/design.md section 4.10): a row that is 0 in one
factor and finite in the other adds exact zeros, so norms, rounding scales and the underflow bound leave it out, and an
example's clip factor does not move with padding rows whose activations' squares overflow; a row that is 0 in one
factor and not finite in the other counts, as ``0 * inf`` is NaN in the per-sample gradient."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from clipping_helpers import flush_to_zero
from torch import nn

from lightning_dp.clipping import PerSampleClipper, rows
from lightning_dp.clipping.rows import active_rows, extreme_entries, zero_and_finite_rows
from lightning_dp.clipping.terms import Factored


def _clipped(
    clipping: str,
    rows: int,
    padding: float,
    uses: int = 1,
    weight_scale: float = 1.0,
    output_gradient: float = 1.0,
    **options: Any,
) -> torch.Tensor:
    """What one example adds to the clipped sum of a 16 x 16 linear layer (weights ``weight_scale`` times a ramp in
    [-1, 1]) applied ``uses`` times: 8 rows of activations 0.5 with output gradients ``output_gradient``, padded to
    ``rows`` rows of activations ``padding`` whose output gradients are 0 (a loss that ignores them). ``options`` go to
    the clipper (``loss_scale`` set after it is built)."""
    layer = nn.Linear(16, 16, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.linspace(-1, 1, 256).view(16, 16) * weight_scale)
    x = torch.full((1, rows, 16), padding)
    x[0, :8] = 0.5
    weights = torch.zeros(1, rows, 16)
    weights[0, :8] = output_gradient
    loss_scale = options.pop("loss_scale", 1.0)
    clipper = PerSampleClipper(layer, clipping=clipping, max_grad_norm=1.0, sum_check_every=None, **options)
    clipper.loss_scale = loss_scale
    try:
        outputs = [layer(x) for _ in range(uses)]
        assert all(bool(out.isfinite().all()) for out in outputs)  # the premise: a finite forward
        clipper.backward(sum(out * weights for out in outputs).sum((1, 2)))
    finally:
        clipper.detach()
    return layer.weight.grad.clone()


@pytest.mark.parametrize("clipping", ["ghost", "mixed", "fgc", "flat"])
@pytest.mark.parametrize("padding", [1.0, 1e19, 1e30])
@pytest.mark.parametrize("uses", [1, 2])
def test_padding_rows_whose_squares_overflow_do_not_move_an_example(clipping: str, padding: float, uses: int) -> None:
    """Padding rows of activations 1e19 or 1e30 (finite, and so is the layer's output; their squares overflow
    float32) made the Gram product, the rounding scale or both NaN (``0 * inf``): the example was dropped exactly when
    another example padded its batch (every engine, found in review). Padded from 8 to 512 rows (ghost's panels, and
    the cross term of two uses), it now adds the same clipped gradient."""
    short = _clipped(clipping, 8, padding, uses)
    long = _clipped(clipping, 512, padding, uses)
    assert 0.99 < float(short.norm()) <= 1.0
    torch.testing.assert_close(long, short, rtol=1e-6, atol=0)


def _batch_sums(clipping: str, monkeypatch: pytest.MonkeyPatch, gathering: bool) -> list[torch.Tensor]:
    """The clipped sums of a linear layer used twice on a batch of 3 examples padded to 512 rows of activations 1e19
    (output gradients 0), example 1 dropped (a NaN output gradient in a row that counts), ``gathering`` rows on the
    CPU or not (what a GPU runs)."""
    with monkeypatch.context() as patch:
        if not gathering:
            patch.setattr(rows, "GATHERING_DEVICES", frozenset())
        torch.manual_seed(0)
        layer = nn.Linear(16, 24)
        x = torch.full((3, 512, 16), 1e19)
        x[:, :40] = torch.randn(3, 40, 16)
        weights = torch.zeros(3, 512, 24)
        weights[:, :40] = torch.randn(3, 40, 24)
        weights[1, 3, 5] = float("nan")  # a non-finite output gradient: the clipper's own factor, zeroed in place
        clipper = PerSampleClipper(layer, clipping=clipping, max_grad_norm=1.0, sum_check_every=None)
        try:
            clipper.backward(sum(layer(x) * weights for _ in range(2)).sum((1, 2)))
        finally:
            clipper.detach()
        return [p.grad.clone() for p in layer.parameters()]


@pytest.mark.parametrize("clipping", ["ghost", "mixed", "flat"])
def test_the_cpus_gathers_and_a_gpus_passes_give_the_same_bits(clipping: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the rows to read again and the dropped example's rows to zero are gathered (``rows.gathers``); a GPU
    passes over whole factors instead (run here on the CPU by emptying ``rows.GATHERING_DEVICES``, as
    bench/op_count.py does). The clipped sums agree bit for bit, the dropped example adding nothing."""
    gathered = _batch_sums(clipping, monkeypatch, gathering=True)
    passed = _batch_sums(clipping, monkeypatch, gathering=False)
    assert all(bool(g.isfinite().all()) and bool(g.ne(0).any()) for g in gathered)
    for a, b in zip(gathered, passed, strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def _seeded(device: torch.device) -> torch.Generator:
    return torch.Generator(device).manual_seed(0)


@pytest.mark.parametrize(
    ("clipping", "padding", "options"),
    [
        ("hutch", 3e38, {"generator_for": _seeded}),  # the projection of a padding row overflowed
        ("hutchpp", 3e38, {"generator_for": _seeded}),
        ("ghost", 3e38, {"loss_scale": 2.0**-8}),  # factors above 1 scaled a padding row to inf: a NaN sum
        ("flat", 3e38, {"loss_scale": 2.0**-8}),
        ("ghost", 1e38, {"clipping_fn": "automatic"}),  # the overflow guard read the padding rows: factor 0
        ("flat", 1e38, {"clipping_fn": "automatic"}),
    ],
)
def test_projections_and_factors_above_1_leave_the_padding_rows_out(
    clipping: str, padding: float, options: dict[str, Any]
) -> None:
    """Padding rows of entries near float32's largest (the layer's output finite, its weights 1e-3): the randomized
    engines' projections of them, the scaling by factors above 1 (a loss scale below 1, automatic clipping) and the
    guard against that scaling's overflow left them in, so the example was dropped, or the sum NaN, exactly when
    padded (found in review). It now adds the same clipped gradient."""
    output_gradient = 1e-3 if options.get("clipping_fn") == "automatic" else 1.0
    short = _clipped(clipping, 8, padding, weight_scale=1e-3, output_gradient=output_gradient, **options)
    long = _clipped(clipping, 512, padding, weight_scale=1e-3, output_gradient=output_gradient, **options)
    assert float(short.norm()) > 0.5
    torch.testing.assert_close(long, short, rtol=1e-6, atol=0)


def test_a_row_zero_in_one_factor_and_not_finite_in_the_other_counts() -> None:
    """``0 * inf`` and ``0 * NaN`` are NaN in the per-sample gradient, so those rows count (the example's norm is not
    finite, and it is dropped whatever the engine); a row 0 in one factor and finite in the other does not."""
    left = torch.ones(1, 5, 3)
    right = torch.ones(1, 5, 2)
    left[0, 1] = float("inf")  # output gradient 0: counts
    right[0, 1] = 0.0
    left[0, 2, 0] = float("nan")  # likewise
    right[0, 2] = 0.0
    left[0, 3] = 3e38  # finite, its square overflows: does not count
    right[0, 3] = 0.0
    right[0, 4] = float("inf")  # and the other way round
    left[0, 4] = 0.0
    term = Factored(left, right, torch.Size([3, 2]))
    assert term.active.tolist() == [[True, True, True, False, True]]


@pytest.mark.parametrize("ftz", [False, True])
def test_zero_and_finite_rows_reads_again_the_rows_whose_norm_underflowed_or_overflowed(
    ftz: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of 1e-30 (square 0) are not 0, rows of 2e19 (square inf) are finite; zeros of either sign are 0, a NaN row
    neither 0 nor finite. The CPU gathers those rows, and tells 0 by the bits: a subnormal row (1e-39) is not 0 under
    flush-to-zero either, which reads it as 0 on this thread only (found in review). The pass a GPU makes over the
    whole factor agrees."""
    x = torch.ones(2, 4, 3)
    x[1, 3] = 1e-39
    x[0, 0] = 1e-30
    x[0, 1] = 0.0
    x[0, 1, 2] = -0.0
    x[0, 2] = 2e19
    x[1, 0, 1] = float("nan")
    x[1, 1, 0] = float("inf")
    x[1, 2, 2] = -float("inf")
    squares = torch.linalg.vector_norm(x, 2, dim=-1).square()
    assert squares[0, 0] == 0 and squares[0, 2] == float("inf")  # the premise
    with flush_to_zero(ftz):
        zero, finite = zero_and_finite_rows(x, squares)
    assert zero.tolist() == [[False, True, False, False], [False, False, False, False]]
    assert finite.tolist() == [[True, True, True, True], [False, False, False, True]]
    low, high = extreme_entries(x, fused=True)  # what a GPU reads: the whole factor, in one pass
    assert torch.equal(low.eq(0) & high.eq(0), zero)
    assert torch.equal(low.isfinite() & high.isfinite(), finite)
    if not ftz:  # the GPU's path, run on the CPU (whose flush-to-zero does not reach a GPU)
        monkeypatch.setattr(rows, "GATHERING_DEVICES", frozenset())
        assert [t.tolist() for t in zero_and_finite_rows(x, squares)] == [zero.tolist(), finite.tolist()]
    cpu = torch.stack(extreme_entries(x))
    torch.testing.assert_close(cpu, torch.stack([low, high]), rtol=0, atol=0, equal_nan=True)


def test_one_hot_rows_count_unless_their_output_gradient_is_0() -> None:
    """Token ids stand for one-hot rows, finite and never 0."""
    right = torch.ones(1, 3, 2)
    right[0, 1] = 0.0
    ids = torch.tensor([[0, 1, 2]])
    assert active_rows(None, right, None, right.norm(dim=-1)).tolist() == [[True, False, True]]
    assert Factored(ids, right, torch.Size([3, 2])).active.tolist() == [[True, False, True]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_zero_and_finite_rows_on_cuda_matches_the_cpu_without_a_host_sync() -> None:
    """On a GPU the whole factor is reduced (a gather of the rows to read again would size its output on the host): the
    same rows, and no synchronisation."""
    x = torch.zeros(2, 4, 3)
    x[0, 1] = 1e-30
    x[0, 2] = 1e19
    x[1, 1, 2] = float("nan")
    squares = torch.linalg.vector_norm(x, 2, dim=-1).square()
    on_device, device_squares = x.cuda(), squares.cuda()
    torch.cuda.set_sync_debug_mode("error")
    try:
        zero, finite = zero_and_finite_rows(on_device, device_squares)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = zero_and_finite_rows(x, squares)
    assert torch.equal(zero.cpu(), expected[0]) and torch.equal(finite.cpu(), expected[1])
