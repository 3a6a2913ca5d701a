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
