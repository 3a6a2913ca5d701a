"""A sample's norm and clip-factor bound do not depend on how many other samples share its batch, at a fixed padded
length on the CPU (docs/design.md section 4.10): torch splits a reduction to a single number over its threads, in
another order than each sample's reduction in a larger batch, so a sample alone in its batch got other bits (found in
review) until :func:`~lightning_dp.clipping.rounding.one_thread_for_one_sample`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_dp.clipping.clipper as clipper_module
from lightning_dp.clipping import PerSampleClipper
from lightning_dp.clipping.rounding import one_thread_for_one_sample


@pytest.fixture
def two_threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def _first_sample(
    layer: nn.Linear, x0: torch.Tensor, w0: torch.Tensor, batch: int, clipping: str, accumulate: bool, monkeypatch
) -> tuple[float, float | None]:
    """Sample 0's norm and (with ``accumulate``) its bound ``nu_0``, in a batch of ``batch`` whose others are random."""
    gen = torch.Generator().manual_seed(batch)
    x = torch.cat([x0, torch.randn(batch - 1, *x0.shape[1:], generator=gen)])
    w = torch.cat([w0, torch.randn(batch - 1, *w0.shape[1:], generator=gen)])
    bounds: list[torch.Tensor] = []
    original = clipper_module.rounded_norm_bound

    def spy(*args):
        bound = original(*args)
        bounds.append(bound[:, 0].clone())
        return bound

    monkeypatch.setattr(clipper_module, "rounded_norm_bound", spy)
    clipper = PerSampleClipper(layer, clipping=clipping, max_grad_norm=1.0, sum_check_every=None)
    try:
        loss = (layer(x) * w).sum((1, 2))
        norms = clipper.backward(loss) if accumulate else clipper.per_sample_norms(loss)
    finally:
        clipper.detach()
        layer.zero_grad(set_to_none=True)
    return float(norms[0]), float(bounds[-1]) if accumulate else None


@pytest.mark.parametrize(
    ("width", "out", "rows"),
    [(256, 3000, 8), (256, 3000, 130), (256, 3000, 700), (256, 3000, 300)],
    ids=["t8", "t130", "t700-panels", "t300"],
)
@pytest.mark.parametrize("clipping", ["ghost", "mixed", "flat", "fgc"])
@pytest.mark.parametrize("accumulate", [True, False], ids=["backward", "per_sample_norms"])
def test_a_samples_norm_and_bound_are_the_same_bits_alone_and_in_a_batch(
    width: int, out: int, rows: int, clipping: str, accumulate: bool, two_threads, monkeypatch
) -> None:
    """With 2 threads, sample 0 alone got other bits than in batches of 2 to 8 (``flat``/``fgc`` at ``[8, 256]``
    activations into 3000 outputs: 1759.1191 against 1759.1193; ``ghost``'s bound at 700 rows), which crafted examples
    whose per-token parts cancel turn into up to about 6e-4 ``C`` each (section 4.10)."""
    torch.manual_seed(0)
    layer = nn.Linear(width, out)
    gen = torch.Generator().manual_seed(rows)
    x0, w0 = torch.randn(1, rows, width, generator=gen), torch.randn(1, rows, out, generator=gen)
    w0[:, rows // 2 :] = 0  # padding: rows the loss ignores
    alone = _first_sample(layer, x0, w0, 1, clipping, accumulate, monkeypatch)
    for batch in (2, 3, 8):
        assert _first_sample(layer, x0, w0, batch, clipping, accumulate, monkeypatch) == alone, batch


def test_the_thread_count_is_one_for_one_sample_on_the_cpu_only_and_restored(two_threads) -> None:
    cpu, meta = torch.device("cpu"), torch.device("meta")
    for batch, device, inside in ((1, cpu, 1), (2, cpu, 2), (1, meta, 2)):
        with one_thread_for_one_sample(batch, device):
            assert torch.get_num_threads() == inside
        assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), one_thread_for_one_sample(1, cpu):
        raise RuntimeError
    assert torch.get_num_threads() == 2
