"""The cyclic Poisson sampler of banded MF (lightning_dp/data/cyclic_poisson.py): step ``t`` draws only from group
``t mod b`` at rate ``b q``; the partition is a function of the index and the key alone."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.data import poisson_dataloader
from lightning_dp.data.cyclic_poisson import CyclicPoissonBatchSampler, cyclic_groups, group_sample_rate
from lightning_dp.runtime.randomness import DPRandomness


def _sampler(n=600, q=0.05, b=4, start=0, seed=0, **kwargs):
    kwargs.setdefault("generator", torch.Generator().manual_seed(seed))
    return CyclicPoissonBatchSampler(n, q, num_groups=b, key=1234, next_step=lambda: start, **kwargs)


def test_each_step_draws_only_from_its_group_at_rate_b_q():
    sampler = _sampler(num_steps=400)
    groups = sampler.groups
    counts = torch.zeros(len(groups))
    for t, batch in enumerate(sampler):
        assert batch, "600 examples at q_b = 0.2: an empty step is vanishingly rare"
        assert set(groups[batch].tolist()) == {t % 4}
        counts[batch] += 1
    # each example is eligible at 100 of the 400 steps, included at each with q_b = 0.2: mean 20 per example
    eligible = 100
    assert abs(counts.sum().item() / (len(groups) * eligible) - 0.2) < 0.01
    assert sampler.group_rate == pytest.approx(0.2)


def test_a_pass_starts_at_the_runs_step_count():
    sampler = _sampler(start=6, num_steps=8)
    for t, batch in enumerate(sampler, start=6):
        assert set(sampler.groups[batch].tolist()) <= {t % 4}


def test_partition_is_a_function_of_index_and_key_only():
    groups = cyclic_groups(1000, 5, key=7)
    assert torch.equal(cyclic_groups(1001, 5, key=7)[:1000], groups), "adding an example moved another one"
    assert torch.equal(cyclic_groups(400, 5, key=7), groups[:400]), "removing the last examples moved another one"
    assert not torch.equal(cyclic_groups(1000, 5, key=8), groups), "the key must change the partition"
    counts = torch.bincount(groups, minlength=5).float()
    assert counts.min() > 160 and counts.max() < 240  # about uniform: 200 +- 5 standard deviations


def test_partition_does_not_depend_on_the_data():
    """Two datasets of the same size but other contents get the same groups: the data never enter the partition."""
    samplers = []
    for seed in (0, 1):
        data = TensorDataset(torch.randn(64, 3, generator=torch.Generator().manual_seed(seed)))
        loader = poisson_dataloader(
            DataLoader(data, batch_size=4),
            sample_rate=0.1,
            generator=torch.Generator().manual_seed(0),
            sampler_class=lambda *args, **kwargs: _sampler(*args, b=3, **kwargs),
        )
        samplers.append(loader.batch_sampler)
    assert torch.equal(samplers[0].groups, samplers[1].groups)
    assert list(samplers[0]) == list(samplers[1])


def test_refusals():
    with pytest.raises(ValueError, match=r"group rate b\*q=1.2 > 1: use a band <= 3"):
        group_sample_rate(4, 0.3)
    assert group_sample_rate(4, 0.25) == 1.0


def test_on_several_ranks_the_union_is_one_cyclic_poisson_sample():
    """W = 3 ranks after the base seed is shared (``DPRandomness.share``, as ``synchronize_randomness`` does): the
    key is the same on every rank (a stream seed of the agreed base seed, not of the rank), so is the partition; at
    step t rank r draws only examples of its shard ``r, r + W, ...`` in group ``t mod b``; the shards are disjoint and
    cover the data; each eligible example is included at rate ``q_b`` whichever rank holds it, independently across
    ranks."""
    n, q, b, world, steps = 60, 0.1, 2, 3, 3000
    streams = []
    for rank in range(world):
        randomness = DPRandomness(seed=None)  # each rank's own base seed first: the shared one must replace it
        randomness.share(4321, rank=rank)
        streams.append(randomness)
    assert len({randomness.stream_seed("cyclic groups") for randomness in streams}) == 1, "the key differs by rank"
    samplers = [
        CyclicPoissonBatchSampler(
            n,
            q,
            num_groups=b,
            key=randomness.stream_seed("cyclic groups"),  # each rank's own, as RunSequence._sampler_class reads it
            next_step=lambda: 5,
            num_steps=steps,
            generator=randomness.sampling,
            rank=rank,
            world_size=world,
        )
        for rank, randomness in enumerate(streams)
    ]
    groups = samplers[0].groups
    assert all(torch.equal(s.groups, groups) for s in samplers)
    assert sorted(torch.cat([s.shard for s in samplers]).tolist()) == list(range(n))
    counts, joint, sizes = torch.zeros(n), 0, []
    first_of = {rank: next(i for i in range(rank, n, world) if groups[i] == 1) for rank in (0, 1)}
    for t, batches in enumerate(zip(*samplers, strict=True), start=5):
        union = sum(batches, [])
        assert len(union) == len(set(union))
        for rank, batch in enumerate(batches):
            assert all(i % world == rank for i in batch)
        assert set(groups[union].tolist()) <= {t % b}
        counts[union] += 1
        sizes.append(len(union))
        joint += (first_of[0] in batches[0]) and (first_of[1] in batches[1])
    eligible = steps // b  # group 1 at the odd steps 5, 7, ...; group 0 at the even ones: 1500 each
    assert torch.allclose(counts / eligible, torch.full((n,), b * q), atol=0.04)
    assert sum(sizes) / steps == pytest.approx(q * n, rel=0.04)  # expected global batch q N, as DP-SGD's
    assert joint / eligible == pytest.approx((b * q) ** 2, abs=0.03)  # independent across ranks
