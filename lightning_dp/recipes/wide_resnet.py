"""The Wide-ResNet of De et al. 2022 ("Unlocking high-accuracy differentially private image classification through
scale", Section 3 and Table 2: WRN-16-4 with Group Normalisation instead of Batch Normalisation), as an ``nn.Module``.

The layout follows the authors' released code (DeepMind ``jax_privacy``,
``experiments/image_classification/models/cifar.py``, ``WideResNet``): a 3x3 convolution to 16 channels, three
stages of ``(depth - 4) / 6`` residual blocks with ``16 w``, ``32 w``, ``64 w`` channels (strides 1, 2, 2), each
convolution preceded by ``ReLU -> GroupNorm(16 groups)`` (in that order), a ``ReLU -> GroupNorm -> 1x1 conv``
shortcut on the first block of each stage and the identity on the others, then ``ReLU -> GroupNorm``, global average
pooling and a linear classifier. Weights are drawn with variance ``1 / fan_in``, biases start at zero.

Its convolutions use scaled weight standardisation (``WSConv2D``): here ``weight_standardisation=True`` makes every
convolution a :class:`~lightning_dp.weight_standardisation.WSConv2d` (same formula, ``eps = 1e-4``, a ``gain`` per
output channel starting at one); the default keeps plain ``nn.Conv2d``.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_dp.weight_standardisation import WSConv2d

#: Normalisations a ``WideResNet`` can use: ``"group"`` (De et al.) and ``"batch"`` (non-private comparisons only;
#: the library's per-sample clipping rejects BatchNorm, which mixes the examples of a batch).
NORMS = ("group", "batch")


def _norm(kind: str, channels: int, groups: int) -> nn.Module:
    if kind == "group":
        return nn.GroupNorm(groups, channels)
    return nn.BatchNorm2d(channels)


def _conv(standardised: bool, in_ch: int, out_ch: int, kernel: int, stride: int) -> nn.Conv2d:
    conv = WSConv2d if standardised else nn.Conv2d
    return conv(in_ch, out_ch, kernel, stride=stride, padding=kernel // 2)


class _PreActConv(nn.Sequential):
    """``ReLU -> norm -> conv``: the unit every convolution of the network sits in (De et al.'s released order)."""

    def __init__(
        self, norm: str, groups: int, standardised: bool, in_ch: int, out_ch: int, kernel: int, stride: int
    ) -> None:
        super().__init__(nn.ReLU(), _norm(norm, in_ch, groups), _conv(standardised, in_ch, out_ch, kernel, stride))


class _Block(nn.Module):
    """A residual block: two ``_PreActConv`` 3x3 units plus the shortcut (a ``_PreActConv`` 1x1 unit on the first
    block of a stage, the identity otherwise)."""

    def __init__(
        self, norm: str, groups: int, standardised: bool, in_ch: int, out_ch: int, stride: int, first: bool
    ) -> None:
        super().__init__()
        unit = (norm, groups, standardised)
        self.residual = nn.Sequential(
            _PreActConv(*unit, in_ch, out_ch, 3, stride), _PreActConv(*unit, out_ch, out_ch, 3, 1)
        )
        self.shortcut = _PreActConv(*unit, in_ch, out_ch, 1, stride) if first else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.residual(x) + self.shortcut(x)


class WideResNet(nn.Module):
    """WRN-``depth``-``width`` for 3-channel images: input ``[B, 3, H, W]`` (any ``H, W >= 4``; CIFAR's 32x32),
    output logits ``[B, num_classes]``.

    Args:
        depth: total depth ``6 n + 4`` (``n`` blocks per stage): 16 for WRN-16-4, 10 for the smallest.
        width: channel multiplier ``w`` (stages of ``16 w``, ``32 w``, ``64 w`` channels): 4 for WRN-16-4.
        num_classes: outputs of the linear classifier.
        groups: GroupNorm groups (De et al.: 16); must divide 16 (the stem's channels) and every stage's width.
        norm: ``"group"`` (default) or ``"batch"`` (see :data:`NORMS`).
        weight_standardisation: every convolution (stem, blocks, shortcuts) a
            :class:`~lightning_dp.weight_standardisation.WSConv2d`, as De et al.'s (default False: ``nn.Conv2d``).

    Raises:
        ValueError: ``depth`` not of the form ``6 n + 4`` with ``n >= 1``, ``width < 1``, ``num_classes < 2``,
            ``groups`` not dividing the channel counts, or an unknown ``norm``.
    """

    def __init__(
        self,
        depth: int = 16,
        width: int = 4,
        num_classes: int = 10,
        groups: int = 16,
        norm: str = "group",
        weight_standardisation: bool = False,
    ):
        super().__init__()
        if depth < 10 or (depth - 4) % 6:
            raise ValueError(f"depth must be 6n + 4 with n >= 1 (10, 16, 22, 28, 40, ...), got {depth}")
        if width < 1 or num_classes < 2:
            raise ValueError(f"width must be >= 1 and num_classes >= 2, got width {width}, num_classes {num_classes}")
        if norm not in NORMS:
            raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {norm!r}")
        if norm == "group" and (groups < 1 or 16 % groups):
            raise ValueError(f"groups must divide 16 (the stem's channels, and so every stage's), got {groups}")
        blocks = (depth - 4) // 6
        self.stem = _conv(weight_standardisation, 3, 16, 3, 1)
        stages: list[nn.Module] = []
        in_ch = 16
        for multiple, stride in ((16, 1), (32, 2), (64, 2)):
            out_ch = multiple * width
            for i in range(blocks):
                stride_i = stride if i == 0 else 1
                stages.append(_Block(norm, groups, weight_standardisation, in_ch, out_ch, stride_i, first=i == 0))
                in_ch = out_ch
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(
            nn.ReLU(), _norm(norm, in_ch, groups), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_ch, num_classes)
        )
        for module in self.modules():
            if isinstance(module, nn.Conv2d | nn.Linear):
                nn.init.kaiming_normal_(module.weight, nonlinearity="linear")  # variance 1 / fan_in
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))
