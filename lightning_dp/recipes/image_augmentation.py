"""The augmentation of De et al. 2022's CIFAR-10 runs (Section 3.2), per row, in torch ops: a random crop after
4-pixel reflect padding and a random horizontal flip, and the generator it draws from.

The randomness is data processing, not DP noise: it comes from a ``torch.Generator`` seeded from the run's seed and
the micro-batch's position (:func:`augmentation_generator`), never from the global RNG or the DP streams, so re-runs
of a micro-batch's step draw the same copies.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

#: De et al. 2022's padding of the random crop, in pixels (reflect padding).
CROP_PADDING = 4


def augmentation_generator(seed: int, *position: int) -> torch.Generator:
    """A CPU generator seeded from ``seed`` and ``position`` (e.g. rank, epoch, batch index) by
    ``numpy.random.SeedSequence``: distinct positions give independent streams, the same position the same one.

    Raises:
        ValueError: a negative value (``SeedSequence`` takes non-negative integers; a negative seed is folded into
            64 bits first, so any ``torch.initial_seed()`` works).
    """
    entropy = [seed % 2**64, *position]
    if any(value < 0 for value in entropy):
        raise ValueError(f"augmentation_generator takes non-negative positions, got {position}")
    state = np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def random_crop_flip(images: torch.Tensor, generator: torch.Generator, padding: int = CROP_PADDING) -> torch.Tensor:
    """Each row of ``images`` randomly cropped after ``padding`` pixels of reflect padding, then flipped with
    probability 1/2.

    Args:
        images: ``[N, C, H, W]`` floating point (any device); the result is differentiable with respect to it.
        generator: a CPU generator (the draws are moved to ``images``' device).
        padding: pixels of reflect padding on each side (De et al.: 4), below ``H`` and ``W``
            (``F.pad(mode="reflect")``: jax_privacy's symmetric padding differs by one pixel's shift).

    Returns:
        ``[N, C, H, W]``, a new tensor.

    Raises:
        ValueError: ``images`` not 4-dimensional, or ``padding`` negative or not below the image size.
    """
    if images.ndim != 4:
        raise ValueError(f"random_crop_flip takes images [N, C, H, W], got shape {tuple(images.shape)}")
    rows, _, height, width = images.shape
    if not 0 <= padding < min(height, width):
        raise ValueError(f"padding must lie in [0, {min(height, width)}) for {height}x{width} images, got {padding}")
    offsets = torch.randint(0, 2 * padding + 1, (rows, 2), generator=generator).to(images.device)
    flips = (torch.rand(rows, generator=generator) < 0.5).to(images.device)
    padded = F.pad(images, (padding,) * 4, mode="reflect") if padding else images
    ys = offsets[:, :1] + torch.arange(height, device=images.device)  # [N, H]
    xs = offsets[:, 1:] + torch.arange(width, device=images.device)  # [N, W]
    xs = torch.where(flips[:, None], xs.flip(1), xs)
    index = torch.arange(rows, device=images.device)[:, None, None]
    return padded.permute(0, 2, 3, 1)[index, ys[:, :, None], xs[:, None, :]].permute(0, 3, 1, 2).contiguous()
