"""The cyclic Poisson sampler of banded MF (lightning_dp/data/cyclic_poisson.py): step ``t`` draws only from group
``t mod b`` at rate ``b q``; the partition is a function of the index and the key alone."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.data import poisson_dataloader
from lightning_dp.data.cyclic_poisson import CyclicPoissonBatchSampler, cyclic_groups, group_sample_rate


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
    with pytest.raises(ValueError, match="runs on one process for now"):
        _sampler(world_size=2)
