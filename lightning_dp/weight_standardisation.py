"""Convolutions with scaled weight standardisation (Brock et al. 2021, "Characterizing signal propagation to close the
performance gap in unnormalized ResNets", Section 4), as De et al. 2022 (Section 3) use them for DP Wide-ResNets.

Each output channel ``r`` uses ``w_hat_r = gain_r * (w_r - mean(w_r)) / sqrt(max(N * var(w_r), eps))`` (population
variance; ``N = C_in / groups * prod(kernel)``). Per-sample clipping handles :class:`WSConv2d` exactly, with its own
layer family (:mod:`lightning_dp.clipping.layers.weight_standardised_conv`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

#: De et al.'s (and ``nfnets``') floor on ``N * var(w_r)``.
DEFAULT_EPS = 1e-4


def standardisation_scale(weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The centred rows and the scale of scaled weight standardisation.

    Args:
        weight: ``[C_out, *rest]``; row ``r`` is ``weight[r].flatten()`` (``N`` values).
        eps: floor on ``N * var(w_r)``.

    Returns:
        ``(centred, inverse)``: ``centred`` ``[C_out, N]`` the rows minus their means; ``inverse`` ``[C_out]`` is
        ``1 / sqrt(max(N * var(w_r), eps))``, so that ``w_hat_r = gain_r * inverse_r * centred_r``.
    """
    rows = weight.flatten(1)
    centred = rows - rows.mean(1, keepdim=True)
    return centred, torch.rsqrt(centred.pow(2).sum(1).clamp_min(eps))


class WSConv2d(nn.Conv2d):
    """``nn.Conv2d`` whose weight is standardised per output channel before each use.

    ``in_channels``, ``out_channels``, ``kernel_size``, ``stride``, ``padding``, ``dilation``, ``groups``,
    ``padding_mode``, ``device`` and ``dtype`` are as in ``nn.Conv2d``.

    Args:
        bias: as ``nn.Conv2d`` (default True).
        eps: floor on ``N * var(w_r)`` (keyword only; default 1e-4, De et al.'s).

    Parameters ``weight`` ``[C_out, C_in / groups, kH, kW]``, ``gain`` ``[C_out]`` (starts at 1), ``bias`` ``[C_out]``;
    input ``[B, C_in, H, W]``, output ``[B, C_out, H', W']``.

    Raises:
        ValueError: ``eps`` not positive and finite.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] | str = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        device: torch.device | None = None,
        dtype: torch.dtype | None = None,
        *,
        eps: float = DEFAULT_EPS,
    ) -> None:
        if not 0 < eps < math.inf:
            raise ValueError(f"eps must be positive and finite (the floor on N * var of a weight row), got {eps}")
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, padding_mode, device, dtype
        )
        self.eps = eps
        self.gain = nn.Parameter(torch.ones(out_channels, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        """``nn.Conv2d``'s initialisation of ``weight`` and ``bias``, and ``gain`` back to one."""
        super().reset_parameters()
        if hasattr(self, "gain"):  # nn.Conv2d.__init__ calls this before gain exists
            nn.init.ones_(self.gain)

    def standardised_weight(self) -> torch.Tensor:
        """``w_hat`` of the shape of ``weight``: ``gain_r * (w_r - mean(w_r)) / sqrt(max(N var(w_r), eps))``."""
        centred, inverse = standardisation_scale(self.weight, self.eps)
        return (centred * (self.gain * inverse)[:, None]).view_as(self.weight)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Conv2d's name)
        return self._conv_forward(input, self.standardised_weight(), self.bias)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, eps={self.eps:g}"
