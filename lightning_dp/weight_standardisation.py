"""Convolutions with scaled weight standardisation, as De et al. 2022 use them for DP training of Wide-ResNets.

Scaled weight standardisation (Brock et al. 2021, "Characterizing signal propagation to close the performance gap in
unnormalized ResNets", Section 4, the ``WSConv2D`` of DeepMind's ``nfnets`` and ``jax_privacy`` code): each output
channel ``r`` of the convolution uses, instead of its weight row ``w_r`` (the ``N = C_in / groups * prod(kernel)``
values feeding that channel),

    ``w_hat_r = gain_r * (w_r - mean(w_r)) / sqrt(max(N * var(w_r), eps))``

(population variance), so every channel's effective weight has zero mean and norm ``gain_r`` whatever ``w_r``'s
scale. De et al. 2022 (Section 3 and their released WRN configuration) standardise every convolution of their
WRN-16-4 with GroupNorm, with ``eps = 1e-4``, ``gain`` starting at one and the bias always on.

Per-sample clipping handles :class:`WSConv2d` with its own layer family
(:mod:`lightning_dp.clipping.layers.weight_standardised_conv`): the per-sample gradients of ``weight`` and ``gain`` are
those of the convolution with the standardised weight, pulled back through the standardisation, exactly, for every
exact engine.
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
    """``nn.Conv2d`` whose weight is standardised per output channel before each use (see the module docstring).

    Args:
        in_channels, out_channels, kernel_size, stride, padding, dilation, groups, padding_mode, device, dtype: as
            ``nn.Conv2d``.
        bias: as ``nn.Conv2d`` (default True, as De et al.).
        eps: floor on ``N * var(w_r)`` (keyword only; default 1e-4, De et al.'s).

    Parameters: ``weight`` ``[C_out, C_in / groups, kH, kW]``, ``gain`` ``[C_out]`` (starts at 1) and ``bias``
    ``[C_out]``. Input ``[B, C_in, H, W]``, output ``[B, C_out, H', W']`` as ``nn.Conv2d``.

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
