"""Poisson sampling: inclusion rate, independence of steps, empty batches, micro-batch splitting."""

import functools

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp.data import PoissonBatchSampler, expected_batch_sample_rate, poisson_dataloader, steps_per_epoch


def test_inclusion_rate_and_variable_sizes():
    sampler = PoissonBatchSampler(1000, 0.05, num_steps=400, generator=torch.Generator().manual_seed(0))
    sizes = [len(b) for b in sampler]
    assert len(sizes) == 400 == len(sampler)
    mean = sum(sizes) / len(sizes)
    assert abs(mean - 50) < 3 * (1000 * 0.05 * 0.95 / 400) ** 0.5 * 2
    assert len(set(sizes)) > 5  # variable batch sizes


def test_each_index_included_with_probability_q():
    sampler = PoissonBatchSampler(20, 0.3, num_steps=4000, generator=torch.Generator().manual_seed(1))
    counts = torch.zeros(20)
    for batch in sampler:
        counts[batch] += 1
    assert torch.allclose(counts / 4000, torch.full((20,), 0.3), atol=0.03)


def test_micro_batches_partition_one_poisson_sample():
    sampler = PoissonBatchSampler(100, 0.2, num_steps=3, micro_batches=4, generator=torch.Generator().manual_seed(2))
    chunks = list(sampler)
    assert len(chunks) == 12 == len(sampler)
    for step in range(3):
        union = sum(chunks[4 * step : 4 * step + 4], [])
        assert len(union) == len(set(union))  # no example twice within a logical step


def test_generator_determinism_and_global_rng_untouched():
    state = torch.random.get_rng_state()
    a = list(PoissonBatchSampler(50, 0.1, num_steps=5, generator=torch.Generator().manual_seed(3)))
    b = list(PoissonBatchSampler(50, 0.1, num_steps=5, generator=torch.Generator().manual_seed(3)))
    assert a == b
    assert torch.equal(state, torch.random.get_rng_state())


def test_empty_batches_have_the_data_shape():
    dataset = TensorDataset(torch.randn(10, 3, 4), torch.arange(10))
    loader = poisson_dataloader(
        DataLoader(dataset, batch_size=2), sample_rate=1e-9, num_steps=3, generator=torch.Generator()
    )
    batches = list(loader)
    assert len(batches) == 3
    x, y = batches[0]
    assert x.shape == (0, 3, 4) and y.shape == (0,) and y.dtype == torch.long


def test_bad_arguments():
    import pytest

    with pytest.raises(ValueError, match="sample_rate"):
        PoissonBatchSampler(10, 0.0, generator=torch.Generator())
    with pytest.raises(ValueError, match="non-empty"):
        PoissonBatchSampler(0, 0.1, generator=torch.Generator())


def test_worker_settings_are_kept():
    dataset = TensorDataset(torch.randn(10, 3))
    loader = DataLoader(dataset, batch_size=2, num_workers=1, prefetch_factor=3, persistent_workers=True)
    poisson = poisson_dataloader(loader, sample_rate=0.5, num_steps=2, generator=torch.Generator().manual_seed(0))
    assert poisson.num_workers == 1 and poisson.prefetch_factor == 3 and poisson.persistent_workers
    assert sum(len(x) for (x,) in poisson) > 0


def test_the_workers_seeds_come_from_the_loaders_generator_or_from_the_step():
    """Each new iterator draws its workers' base seed from the loader's ``generator`` (the user's, kept in the copy);
    with a sampler keyed by the step (``exact_resume``), from a generator reseeded by the step the iterator starts at.
    Torch's global generator (the model's dropout) is left alone either way."""
    dataset = TensorDataset(torch.randn(10, 3))
    users = torch.Generator().manual_seed(1)
    copy = poisson_dataloader(DataLoader(dataset, generator=users), sample_rate=0.5, generator=torch.Generator())
    assert copy.generator is users
    step = {"next": 3}
    keyed_sampler = functools.partial(PoissonBatchSampler, next_step=lambda: step["next"], step_seed=lambda t: 7 + t)
    keyed = poisson_dataloader(
        DataLoader(dataset, generator=users), sample_rate=0.5, generator=torch.Generator(), sampler_class=keyed_sampler
    )
    state = torch.random.get_rng_state()
    seeds = []
    for step["next"] in (3, 3, 4):
        seeds.append(iter(keyed)._base_seed)  # what the workers are seeded from
        iter(copy)
    assert seeds[0] == seeds[1] != seeds[2]
    assert torch.equal(state, torch.random.get_rng_state())


def test_epoch_length_and_rate_from_the_nominal_batch():
    assert steps_per_epoch(0.3) == 4  # ceil(1/q): an epoch covers the data at least once in expectation
    assert steps_per_epoch(1.0) == 1
    assert PoissonBatchSampler(100, 0.3, generator=torch.Generator()).num_steps == 4
    assert expected_batch_sample_rate(num_samples=1000, batch_size=8, micro_batches=2, world_size=2) == 0.032
    assert expected_batch_sample_rate(num_samples=10, batch_size=64) == 1.0
    with pytest.raises(ValueError, match="positive dataset size and batch size"):
        expected_batch_sample_rate(num_samples=10, batch_size=0)


def test_length_grouping_sorts_each_logical_batch_and_keeps_its_examples():
    lengths = torch.randint(1, 6, (200,), generator=torch.Generator().manual_seed(5))
    sampler = dict(num_steps=5, micro_batches=4)
    plain = list(PoissonBatchSampler(200, 0.2, **sampler, generator=torch.Generator().manual_seed(4)))
    grouped = list(
        PoissonBatchSampler(200, 0.2, **sampler, generator=torch.Generator().manual_seed(4), lengths=lengths)
    )
    assert [len(chunk) for chunk in plain] == [len(chunk) for chunk in grouped]  # the same micro-batch sizes
    for step in range(5):
        before, after = sum(plain[4 * step : 4 * step + 4], []), sum(grouped[4 * step : 4 * step + 4], [])
        assert sorted(before) == sorted(after)  # the same Poisson sample: the accountant's assumption holds
        keys = [(-int(lengths[i]), i) for i in after]
        assert keys == sorted(keys)  # longest first, ties in dataset order
    with pytest.raises(ValueError, match="lengths has 3 entries for a dataset of 200"):
        PoissonBatchSampler(200, 0.2, generator=torch.Generator(), lengths=[1, 2, 3])
