"""Cyclic Poisson sampling over ``b`` groups: the sampling of amplified banded matrix factorization.

The training set is partitioned into ``b`` groups before training; step ``t`` Poisson-samples group ``t mod b`` only,
each of its examples independently with probability ``q_b = b q`` (``q`` the nominal rate, so that the expected batch
``q N`` is DP-SGD's). Source: Choquette-Choo et al. 2023, "(Amplified) Banded Matrix Factorization", Section 5; the
accountant is :class:`~lightning_dp.accounting.banded_mf.BandedMFAccountant` (docs/design.md section 5.1).

What the accountant assumes, and how this module provides it:

- **A partition fixed before training, independent of the data, that no other example leaves when one is added or
  removed.** Example ``i``'s group is a keyed hash of its index, :func:`cyclic_groups`: the key is a 64-bit stream
  seed of the run's dedicated randomness (never the data), and the group of ``i`` depends on ``i`` and the key
  alone, not on ``N`` or on any other example. An equal-size split of a shuffle would not do: adding one example
  moves others across the split points, which only replace-one adjacency tolerates. The hash makes the groups of
  different indices look independent and uniform; that is what lets an example's removal (which renumbers the later
  examples) leave the law of everyone else's groups unchanged, so the key must stay as secret as any seed.
- **Independent Bernoulli(``q_b``) inclusion at each of the group's steps, independent of the noise**: one uniform
  per example and step from the run's sampling generator (never the noise's), ``N`` uniforms at every step whatever
  the data, and no cap on the batch size.
- **On ``W`` processes, one cyclic-Poisson sample of the whole dataset per step**: every rank computes the same
  partition (the groups are a function of the GLOBAL index and of the key, a stream seed of the base seed the ranks
  agree on, ``DistributedContext.synchronize_randomness``), every rank reads the same step count ``t``, and rank
  ``r`` draws one uniform per example of its shard ``r, r + W, ...`` from its own sampling generator, keeping those
  of group ``t mod b`` below ``q_b``. The shards partition the dataset, so the union over the ranks includes each
  example of group ``t mod b`` independently with probability ``q_b`` and no other (as the plain Poisson sampler's
  union is one global Poisson sample, docs/design.md section 8).
- **Step ``t`` samples group ``t mod b`` with ``t`` the optimizer step the batch is used at**: each pass over the
  loader (an epoch, a reloaded loader) starts at ``t = next_step()``, the number of steps the run has taken, and
  counts the logical batches it yields. The adapters use every batch of a pass, in order, at consecutive steps; a
  pass they stop early (``limit_train_batches``, the budget) leaves no gap, since the next pass reads the step count
  again. A trainer that discards batches at the start of a pass (HF's ``skip_first_batches`` on resume) would shift
  the groups against the steps; ``DPTrainer`` refuses that case.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from lightning_dp.data.poisson import PoissonBatchSampler

_MASK64 = np.uint64(2**64 - 1)


def group_sample_rate(num_groups: int, sample_rate: float) -> float:
    """``q_b = b q``, the rate at which a step samples its group.

    Raises:
        ValueError: ``b q > 1`` (one line saying what to change).
    """
    rate = num_groups * sample_rate
    if rate > 1.0 + 1e-12:
        raise ValueError(
            f"correlation_band={num_groups} with sample rate q={sample_rate:.4g} needs a group rate b*q={rate:.4g} > "
            f"1: use a band <= {max(1, math.floor(1 / sample_rate))} or a smaller expected batch"
        )
    return min(rate, 1.0)


def blt_num_groups(sample_rate: float) -> int:
    """``b = floor(1 / q)`` (at least 1), the cyclic groups of ``noise_correlation='blt'``: the largest ``b`` with
    ``b q <= 1``, so each example takes part at most once every ``b`` steps (about once per pass over the data), the
    separation its min-separation accountant rewards (docs/design.md section 5.1).

    Raises:
        ValueError: ``q`` outside ``(0, 1]``.
    """
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"the sample rate q must lie in (0, 1], got {sample_rate}")
    groups = math.floor(1.0 / sample_rate + 1e-9)
    return max(1, groups - 1 if groups * sample_rate > 1.0 + 1e-12 else groups)


def _splitmix64(values: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser (Steele, Lea & Flood 2014), elementwise on ``uint64`` (wrapping arithmetic)."""
    z = values.astype(np.uint64)
    with np.errstate(over="ignore"):
        z = (z + np.uint64(0x9E3779B97F4A7C15)) & _MASK64
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
    return z ^ (z >> np.uint64(31))


def cyclic_groups(num_samples: int, num_groups: int, key: int) -> torch.Tensor:
    """Each example's group: ``splitmix64(splitmix64(key) xor i) mod b`` for index ``i``.

    Args:
        num_samples: ``N >= 1``.
        num_groups: ``b >= 1``.
        key: a 64-bit key from the run's dedicated randomness (never from the data; never released).

    Returns:
        ``[N]`` int64 in ``[0, b)``; entry ``i`` depends on ``i``, ``b`` and ``key`` only (not on ``N``).

    Raises:
        ValueError: ``N < 1`` or ``b < 1``.
    """
    if num_samples < 1 or num_groups < 1:
        raise ValueError(f"need N >= 1 examples and b >= 1 groups, got N={num_samples}, b={num_groups}")
    mixed_key = _splitmix64(np.array([int(key) & (2**64 - 1)], dtype=np.uint64))[0]
    hashes = _splitmix64(np.arange(num_samples, dtype=np.uint64) ^ mixed_key)
    return torch.from_numpy((hashes % np.uint64(num_groups)).astype(np.int64))


class CyclicPoissonBatchSampler(PoissonBatchSampler):
    """A :class:`~lightning_dp.data.poisson.PoissonBatchSampler` whose step ``t`` samples only group ``t mod b``, at
    rate ``q_b = b q`` (module docstring); on ``W`` processes, rank ``r`` samples the part of that group in its shard
    ``range(r, N, W)``.

    Args:
        num_samples: dataset size N.
        sample_rate: the nominal rate ``q``; each step samples its group at ``b q``.
        num_groups: ``b >= 1``.
        key: the partition's key (:func:`cyclic_groups`), or a function returning it, read when a pass starts (a key
            the run's randomness fixes after the sampler is built: a checkpoint's, rank 0's).
        next_step: the optimizer step the first batch of a pass is used at (the run's step count), read when a pass
            starts.
        **kwargs: the other arguments of :class:`~lightning_dp.data.poisson.PoissonBatchSampler` (``num_steps``,
            ``micro_batches``, ``generator``, ``lengths``, ``rank``, ``world_size``, ``step_seed``). The key and the
            step count must be the same on every rank (the ranks then agree on the partition and on each step's group).

    Raises:
        ValueError: ``b q > 1``, and what :class:`PoissonBatchSampler` refuses.
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        *,
        num_groups: int,
        key: int | Callable[[], int],
        next_step: Callable[[], int],
        **kwargs: Any,
    ) -> None:
        super().__init__(num_samples, sample_rate, next_step=next_step, **kwargs)
        self.num_groups = int(num_groups)
        self.group_rate = group_sample_rate(self.num_groups, self.sample_rate)
        self._key = key if callable(key) else lambda: key
        self._partition: tuple[int, torch.Tensor] | None = None  # (key, groups) of the last pass

    @property
    def groups(self) -> torch.Tensor:
        """``[N]`` each example's group (by global index, the same on every rank), for the current key."""
        key = int(self._key())
        if self._partition is None or self._partition[0] != key:
            self._partition = key, cyclic_groups(self.num_samples, self.num_groups, key)
        return self._partition[1]

    def _logical_batches(self) -> Iterator[torch.Tensor]:
        """Step ``t`` of the pass (``t`` from :attr:`next_step`): the examples of group ``t mod b`` whose uniform is
        below ``q_b``, among this rank's shard; one uniform per example of the shard is drawn at every step."""
        shard_groups = self.groups[self.shard]  # the key read once per pass
        for step in self._steps():
            included = torch.rand(len(self.shard), generator=self.generator) < self.group_rate
            yield self.shard[included & (shard_groups == step % self.num_groups)]
