"""The underflow bound of the clip factors (``clipping/underflow.py``, docs/design.md section 4.10) is a function of the
example alone: it counts only the rows that are not 0 in either factor, so it does not move with the length another
example pads the batch to, and it is the same whichever path (Gram product or materialised gradient) an engine takes,
with a margin over what the paths lose differently."""

from __future__ import annotations

import pytest
import torch
from clipping_helpers import flush_to_zero
from torch import nn

from lightning_dp.clipping import PerSampleClipper
from lightning_dp.clipping.terms import Factored
from lightning_dp.clipping.underflow import row_squares, underflow_bound


def _clipped_norm(clipping: str, rows: int, tiny: float, huge: float, bound: float) -> float:
    """The norm of what one example adds to the clipped sum of a 16 x 16 linear layer: 8 rows of activations ``tiny``
    with output gradients ``huge``, padded to ``rows`` rows of activations 1 whose output gradients are 0 (a loss that
    ignores them)."""
    layer = nn.Linear(16, 16, bias=False)
    x = torch.ones(1, rows, 16)
    x[0, :8] = tiny
    weights = torch.zeros(1, rows, 16)
    weights[0, :8] = huge
    clipper = PerSampleClipper(layer, clipping=clipping, max_grad_norm=bound, sum_check_every=None)
    try:
        clipper.backward((layer(x) * weights).sum((1, 2)))
    finally:
        clipper.detach()
    return float(layer.weight.grad.double().norm())


@pytest.mark.parametrize("clipping", ["ghost", "mixed", "fgc", "flat"])
@pytest.mark.parametrize(
    ("ftz", "tiny", "huge", "bound"),
    [(False, 1e-20, 1e18, 1.0), (True, 1e-19, 1e17, 0.32)],
)
def test_an_underflowing_examples_factor_does_not_move_with_the_padded_length(
    clipping: str, ftz: bool, tiny: float, huge: float, bound: float
) -> None:
    """An example whose activations' squares underflow and whose output gradients are large, its factor set by the
    underflow bound. Counting all rows, the bound grew with the padding another example forces: padded from 8 to 512
    rows, ``ghost`` moved the example's clipped gradient from 0.046 ``C`` to 0.006 ``C``, and ``mixed``, which takes the
    ghost norm at 8 rows and materialises at 512, from 0.046 ``C`` to ``C``; a crafted copy each, the release moved by
    up to ``C`` per copy. Under flush-to-zero the two paths of ``mixed`` lose different amounts to underflow (4 % of
    ``C`` per copy before the margin)."""
    with flush_to_zero(ftz):
        short = _clipped_norm(clipping, 8, tiny, huge, bound)
        long = _clipped_norm(clipping, 512, tiny, huge, bound)
    assert 0 < short <= bound * (1 + 1e-4)
    assert abs(short - long) <= 2**-20 * bound  # what the margin allows the two paths


@pytest.mark.parametrize("clipping", ["ghost", "mixed", "flat"])
def test_rows_of_norm_1e19_keep_a_finite_bound(clipping: str) -> None:
    """Activation rows of norm 1e19 (squares 1e38) with output gradients 1e-20: a gradient of norm 3.2. Their squares
    summed over the rows overflowed the bound, which made the example's factor 0; each row's share is now scaled
    first."""
    assert 0 < _clipped_norm(clipping, 8, 2.5e18, 1e-20, 1.0) <= 1.0


def test_the_bound_counts_the_rows_that_are_nonzero_in_both_factors() -> None:
    """``4 tau T (P ||R||^2 + Q ||L||^2 + T)`` over the rows that are not 0 in either factor, at least ``4 tau P Q``;
    noted squares (an engine's Gram diagonals) and computed ones give the same bound."""
    tau = torch.finfo(torch.float32).tiny
    left, right = torch.randn(2, 6, 3), torch.randn(2, 6, 5) * 1e10
    left[0, 4:] = 0  # padding in the left factor
    right[1, :2] = 0  # and in the right
    term = Factored(left, right, torch.Size([3, 5]))
    rows = torch.tensor([4.0, 4.0])
    left_squares = torch.stack([left[0, :4].square().sum(), left[1, 2:].square().sum()])
    right_squares = torch.stack([right[0, :4].square().sum(), right[1, 2:].square().sum()])
    expected = 4 * tau * rows * (3 * right_squares + 5 * left_squares + rows)
    computed = underflow_bound([term])
    torch.testing.assert_close(computed, expected, rtol=1e-5, atol=0)
    noted = Factored(left, right, torch.Size([3, 5]))
    noted.note_factor_squares(*row_squares(term), term.active)
    torch.testing.assert_close(underflow_bound([noted]), computed, rtol=1e-6, atol=0)
    zeros = Factored(torch.zeros(2, 6, 3), right, torch.Size([3, 5]))
    assert torch.equal(underflow_bound([zeros]), torch.full((2,), 4 * tau * 15))
