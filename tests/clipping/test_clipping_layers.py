"""Per-sample clipping of Conv3d, ConvTranspose1d/2d/3d, affine InstanceNorm and PReLU against the torch.func
oracle."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from clipping_helpers import ENGINES, check_against_oracle, rand, randomise
from torch import nn

from lightning_dp.clipping import PerSampleClipper, UnsupportedModuleError

B = 3


class _Twice(nn.Module):
    """``layer(layer(x))``: one module called twice, its two uses' terms summed."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.layer(x) - 0.5)


CASES: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "conv3d": (
        lambda: nn.Conv3d(2, 3, (2, 3, 2), stride=(1, 2, 1), padding=1, dilation=(1, 1, 2)),
        lambda: rand(B, 2, 4, 5, 5),
    ),
    "conv3d_groups": (lambda: nn.Conv3d(4, 2, 2, groups=2, bias=False), lambda: rand(B, 4, 3, 3, 3)),
    "conv_transpose1d": (
        lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1),
        lambda: rand(B, 3, 7),
    ),
    "conv_transpose1d_dilation_op": (
        lambda: nn.ConvTranspose1d(2, 3, 3, stride=2, dilation=3, output_padding=2, bias=False),
        lambda: rand(B, 2, 5),
    ),
    "conv_transpose2d": (
        lambda: nn.ConvTranspose2d(3, 4, (3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
        lambda: rand(B, 3, 4, 5),
    ),
    "conv_transpose2d_groups": (
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2),
        lambda: rand(B, 4, 3, 3),
    ),
    "conv_transpose3d": (lambda: nn.ConvTranspose3d(2, 3, 2, stride=2, padding=(0, 1, 0)), lambda: rand(B, 2, 2, 3, 2)),
    "instance_norm1d": (lambda: nn.InstanceNorm1d(3, affine=True), lambda: rand(B, 3, 7)),
    "instance_norm2d": (lambda: nn.InstanceNorm2d(3, affine=True), lambda: rand(B, 3, 4, 5)),
    "instance_norm3d": (lambda: nn.InstanceNorm3d(2, affine=True), lambda: rand(B, 2, 3, 3, 4)),
    "prelu_shared": (lambda: nn.Sequential(nn.Linear(5, 4), nn.PReLU(), nn.Linear(4, 3)), lambda: rand(B, 5)),
    "prelu_channels": (lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.PReLU(3)), lambda: rand(B, 2, 5, 5)),
    "prelu_channels_flat": (lambda: nn.Sequential(nn.Linear(5, 4), nn.PReLU(4)), lambda: rand(B, 5)),
    "prelu_channels_1d": (lambda: nn.Sequential(nn.Conv1d(2, 3, 3), nn.PReLU(3)), lambda: rand(B, 2, 6)),
    "prelu_tokens": (lambda: nn.Sequential(nn.Linear(6, 6), nn.PReLU()), lambda: rand(B, 7, 6)),
    "prelu_twice": (lambda: _Twice(nn.PReLU(4)), lambda: rand(B, 4)),
}


@pytest.mark.parametrize("clipping", ENGINES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_matches_oracle(case: str, clipping: str) -> None:
    make_layer, make_input = CASES[case]
    check_against_oracle(randomise(make_layer()), (make_input(),), clipping)


@pytest.mark.parametrize("clipping", ENGINES)
def test_conv_transpose_with_output_size(clipping: str) -> None:
    class Up(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.ConvTranspose2d(3, 2, 3, stride=2, padding=1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.up(x, output_size=[8, 8])

    check_against_oracle(randomise(Up()), (rand(B, 3, 4, 4),), clipping)


@pytest.mark.parametrize("clipping", ENGINES)
def test_small_unet_like_3d(clipping: str) -> None:
    model = nn.Sequential(
        nn.Conv3d(1, 4, 3, padding=1),
        nn.InstanceNorm3d(4, affine=True),
        nn.ReLU(),
        nn.Conv3d(4, 4, 2, stride=2),
        nn.ConvTranspose3d(4, 2, 2, stride=2),
    )
    check_against_oracle(randomise(model), (rand(B, 1, 4, 4, 4),), clipping)


def test_affine_instance_norm_with_running_stats_rejected() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.InstanceNorm2d(4, affine=True, track_running_stats=True))
    with pytest.raises(UnsupportedModuleError, match="set track_running_stats=False.*GroupNorm"):
        PerSampleClipper(model, max_grad_norm=1.0)


def test_a_frozen_prelu_has_no_term() -> None:
    model = nn.Sequential(nn.Linear(5, 4), nn.PReLU())
    model[1].weight.requires_grad_(False)
    check_against_oracle(randomise(model), (rand(B, 5),), "ghost")


class _Bag(nn.Module):
    """An ``nn.EmbeddingBag`` over 1-D ids with offsets (and optional per-sample weights), then a linear head."""

    def __init__(self, **options) -> None:
        super().__init__()
        self.bag = nn.EmbeddingBag(9, 4, **options)
        self.head = nn.Linear(4, 2)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.bag(ids, offsets, per_sample_weights=weights))


def _bag_oracle(model: nn.Module, inputs: tuple[torch.Tensor, ...], loss_fn) -> dict[str, torch.Tensor]:
    """Per-bag gradients by a loop over bags, each a batch of one bag (offsets ``[0]``)."""
    ids, offsets, *weights = inputs
    ends = [*offsets[1:].tolist(), len(ids)]
    grads: dict[str, list[torch.Tensor]] = {}
    for start, end in zip(offsets.tolist(), ends, strict=True):
        one = (ids[start:end], torch.zeros(1, dtype=torch.long), *(w[start:end] for w in weights))
        named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        values = torch.autograd.grad(loss_fn(model, one).sum(), list(named.values()))
        for name, value in zip(named, values, strict=True):
            grads.setdefault(name, []).append(value)
    return {name: torch.stack(values) for name, values in grads.items()}


BAG_IDS = torch.tensor([1, 2, 2, 0, 5, 7, 7, 7, 3, 8, 0])
BAG_OFFSETS = torch.tensor([0, 3, 4, 4, 8])  # bags of 3, 1, 0 (empty), 4 and 3 entries


@pytest.mark.parametrize("clipping", ENGINES)
@pytest.mark.parametrize(
    ("options", "weighted"),
    [
        ({"mode": "sum"}, False),
        ({"mode": "mean"}, False),
        ({"mode": "sum"}, True),
        ({"mode": "mean", "padding_idx": 0}, False),
    ],
    ids=["sum", "mean", "sum_weighted", "mean_padding"],
)
def test_embedding_bag_with_offsets_matches_a_loop_over_bags(options, weighted, clipping) -> None:
    model = randomise(_Bag(**options))
    inputs = (BAG_IDS, BAG_OFFSETS) + ((rand(len(BAG_IDS)),) if weighted else ())
    check_against_oracle(model, inputs, clipping, oracle=_bag_oracle)


@pytest.mark.filterwarnings("ignore:There is a performance drop")  # the oracle's vmap over embedding_bag
@pytest.mark.parametrize("clipping", ENGINES)
def test_embedding_bag_of_2d_ids_matches_oracle(clipping: str) -> None:
    model = randomise(nn.Sequential(nn.EmbeddingBag(9, 4, mode="mean"), nn.Linear(4, 2)))
    check_against_oracle(model, (torch.randint(0, 9, (B, 5), generator=torch.Generator().manual_seed(4)),), clipping)


@pytest.mark.parametrize(
    ("options", "match"), [({"mode": "max"}, "mode='max'"), ({"scale_grad_by_freq": True}, "mixes")]
)
def test_embedding_bag_configurations_that_mix_or_select_are_refused(options, match) -> None:
    with pytest.raises(UnsupportedModuleError, match=match):
        PerSampleClipper(nn.EmbeddingBag(9, 4, **options), max_grad_norm=1.0)
