"""Poisson sampling: each example joins each logical batch independently with probability ``sample_rate``.

The sampling the accountants assume (Abadi et al. 2016; Mironov et al. 2019; docs/design.md section 3.2). Batch
sizes vary and may be zero. The ``micro_batches`` chunks of one logical step together are ONE Poisson sample; given
lengths, each logical batch is sorted longest first before splitting (order does not change the sample). On ``W``
processes rank ``r`` samples its shard ``r, r + W, ...`` at the global rate ``q``: the union is one global Poisson
sample (docs/design.md section 8).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data._utils.collate import default_collate

from lightning_dp.data.batch_tensors import batch_tensors
from lightning_dp.data.example_lists import (
    EXAMPLE_SEQUENCES,
    ValueSequence,
    example_copy,
    find_example_paths,
    mark_examples,
)
from lightning_dp.runtime.randomness import derive_seed


def validate_sample_rate(sample_rate: float) -> None:
    """Raise ``ValueError`` unless the Poisson rate q of a training run lies in (0, 1]."""
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must lie in (0, 1], got {sample_rate}")


def steps_per_epoch(sample_rate: float) -> int:
    """Logical steps of one epoch at rate q: ``ceil(1 / q)``, at least one (one pass over the data in expectation,
    rounded up so that no epoch covers less than the dataset)."""
    validate_sample_rate(sample_rate)
    return max(1, math.ceil(1.0 / sample_rate))


def expected_batch_sample_rate(
    *, num_samples: int, batch_size: int, micro_batches: int = 1, world_size: int = 1
) -> float:
    """The Poisson rate that makes one logical step's expected size the trainer's nominal batch:
    ``q = min(1, batch_size * micro_batches * world_size / N)`` (``batch_size`` per process and micro-batch).

    Raises:
        ValueError: non-positive ``num_samples`` or ``batch_size``.
    """
    if num_samples <= 0 or batch_size <= 0:
        raise ValueError(f"need a positive dataset size and batch size, got N={num_samples}, batch={batch_size}")
    return min(1.0, batch_size * micro_batches * world_size / num_samples)


class PoissonBatchSampler(Sampler[list[int]]):
    """Yields ``num_steps * micro_batches`` index lists; each step is an independent Poisson sample.

    Args:
        num_samples: dataset size N (the whole dataset, also on several processes).
        sample_rate: inclusion probability q in (0, 1] (global: the same on every rank).
        num_steps: logical steps per epoch (default :func:`steps_per_epoch`, ``ceil(1 / q)``).
        micro_batches: physical chunks each logical batch is split into (gradient accumulation).
        generator: a dedicated CPU sampling generator, never the global RNG; on several processes independent per rank
            (``DPRandomness.share``).
        rank: this process's rank; it samples the shard ``range(rank, N, world_size)``.
        world_size: number of processes W sharing the dataset; 1 (default) samples all of it.
        lengths: ``[N]`` the examples' lengths (tokens): each logical batch is sorted by decreasing length (ties in
            dataset order) before it is split; ``None`` (default): dataset order.
        next_step: the optimizer step the first batch of a pass is used at (the run's step count), read when a pass
            starts; ``None``: the steps are not numbered (each pass counts from 0).
        step_seed: ``step -> seed``: reseed ``generator`` before each step's draws, so that step ``t``'s batch depends
            on ``t`` alone, not on what was drawn before (an exact resume); ``None`` (default): one continuing stream.

    Raises:
        ValueError: non-positive ``num_samples``, ``sample_rate`` outside (0, 1], non-positive counts, ``rank``
            outside ``[0, world_size)``, ``lengths`` not of ``num_samples`` entries.
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        *,
        num_steps: int | None = None,
        micro_batches: int = 1,
        generator: torch.Generator,
        rank: int = 0,
        world_size: int = 1,
        lengths: Sequence[int] | torch.Tensor | None = None,
        next_step: Callable[[], int] | None = None,
        step_seed: Callable[[int], int] | None = None,
    ) -> None:
        if num_samples <= 0:
            raise ValueError(f"Poisson sampling needs a non-empty dataset, got {num_samples} examples")
        validate_sample_rate(sample_rate)
        self.num_samples = num_samples
        self.sample_rate = float(sample_rate)
        self.num_steps = int(num_steps) if num_steps is not None else steps_per_epoch(sample_rate)
        if self.num_steps <= 0 or micro_batches <= 0:
            raise ValueError(f"num_steps and micro_batches must be positive, got {num_steps}, {micro_batches}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in [0, world_size), got rank={rank}, world_size={world_size}")
        self.micro_batches = int(micro_batches)
        self.generator = generator
        self.rank, self.world_size = int(rank), int(world_size)
        #: the dataset indices this rank samples from (all of them on one process)
        self.shard = torch.arange(self.rank, num_samples, self.world_size)
        #: ``[N]`` the examples' lengths (``None``: logical batches keep the dataset's order)
        self.lengths = None if lengths is None else torch.as_tensor(lengths, dtype=torch.long).flatten()
        if self.lengths is not None and len(self.lengths) != num_samples:
            raise ValueError(f"lengths has {len(self.lengths)} entries for a dataset of {num_samples} examples")
        self.next_step, self.step_seed = next_step, step_seed

    def __len__(self) -> int:
        return self.num_steps * self.micro_batches

    def __iter__(self) -> Iterator[list[int]]:
        for indices in self._logical_batches():
            if self.lengths is not None:
                indices = indices[torch.sort(self.lengths[indices], descending=True, stable=True).indices]
            for chunk in torch.tensor_split(indices, self.micro_batches):
                yield chunk.tolist()

    def _steps(self) -> Iterator[int]:
        """The optimizer steps of one pass (from :attr:`next_step`, read as the pass starts), with ``generator``
        reseeded for each by :attr:`step_seed` when given."""
        first = int(self.next_step()) if self.next_step is not None else 0
        for step in range(first, first + self.num_steps):
            if self.step_seed is not None:
                self.generator.manual_seed(self.step_seed(step))
            yield step

    def _logical_batches(self) -> Iterator[torch.Tensor]:
        """The dataset indices of each logical step of one pass, in dataset order: a Poisson sample of the shard."""
        for _ in self._steps():
            yield self.shard[torch.rand(len(self.shard), generator=self.generator) < self.sample_rate]


def _empty_like_batch(batch: Any) -> Any:
    """The same structure (dicts and other mappings, lists, tuples, namedtuples, dataclasses) with every tensor but a
    0-dim one cut to zero rows and every marked per-example sequence emptied (an empty Poisson batch)."""

    def cut(value: torch.Tensor | ValueSequence) -> Any:
        if isinstance(value, torch.Tensor):
            return value if value.ndim == 0 else value[:0]
        return type(value)()

    return apply_to_collection(batch, (torch.Tensor, *EXAMPLE_SEQUENCES), cut)


class EmptyBatchCollate:
    """Wraps a ``collate_fn`` so an empty index list yields a batch of zero-row tensors shaped like the data, and
    every batch has its per-example lists and tuples marked (:func:`~lightning_dp.data.example_lists.mark_examples`).

    The zero-row structure comes from collating ``dataset[0]``; where the per-example sequences are, from comparing, at
    construction, the collates of ``dataset[0]`` once and twice, not from any draw. Each collate of ``dataset[0]`` gets
    a copy (:func:`~lightning_dp.data.example_lists.example_copy`: a collator may change what it is given, and a
    dataset may return what it stores). Picklable (works with worker processes).
    """

    def __init__(self, collate_fn: Callable[[list[Any]], Any] | None, dataset: Dataset) -> None:
        """Wrap ``collate_fn`` (``None``: torch's ``default_collate``) for ``dataset``, forming an empty batch once.

        Raises:
            ValueError: the collated ``dataset[0]`` holds neither a tensor of one dimension or more that an empty batch
                can cut nor a per-example sequence (tensors inside a custom class): an empty draw would then train
                ``dataset[0]`` as if it were drawn.
        """
        self.collate_fn = collate_fn or default_collate
        self.dataset = dataset
        one, paths = find_example_paths(self.collate_fn, dataset[0])
        #: Where every batch holds one entry per example (the same places in every batch).
        self.example_paths = paths
        empty = _empty_like_batch(mark_examples(one, self.example_paths))
        if not (batch_tensors(empty, min_ndim=1) or self.example_paths):
            raise ValueError(
                "the training loader's batches hold no tensor that lightning_dp can cut to zero rows for an empty "
                "Poisson batch (tensors inside a custom class are not seen): collate into tensors in dicts, lists, "
                "tuples, namedtuples or dataclasses"
            )

    def __call__(self, samples: Sequence[Any]) -> Any:
        if len(samples) == 0:
            first = example_copy(self.dataset[0])
            return _empty_like_batch(mark_examples(self.collate_fn([first]), self.example_paths))
        return mark_examples(self.collate_fn(list(samples)), self.example_paths)


def poisson_dataloader(
    loader: DataLoader,
    *,
    sample_rate: float,
    num_steps: int | None = None,
    micro_batches: int = 1,
    generator: torch.Generator,
    rank: int = 0,
    world_size: int = 1,
    lengths: Sequence[int] | torch.Tensor | None = None,
    dataset: Dataset | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    wrap_sampler: Callable[[PoissonBatchSampler], Sampler] | None = None,
    sampler_class: Callable[..., PoissonBatchSampler] = PoissonBatchSampler,
) -> DataLoader:
    """A copy of ``loader`` (same dataset, collate, workers) drawing Poisson batches (``rank``'s shard of
    ``world_size``; micro-batches grouped by ``lengths`` when given; see :class:`PoissonBatchSampler`).
    ``dataset`` and ``collate_fn``, when given, replace the loader's (e.g. the data regrouped by user);
    ``wrap_sampler`` wraps the Poisson batch sampler (e.g. :class:`~lightning_dp.data.users.UserDraws`);
    ``sampler_class`` builds it from :class:`PoissonBatchSampler`'s arguments (e.g. a ``functools.partial`` of
    :class:`~lightning_dp.data.cyclic_poisson.CyclicPoissonBatchSampler`). Each new iterator draws its workers' base
    seed from the loader's ``generator`` (else torch's global one), as any ``DataLoader`` does; when the sampler is
    keyed by the step (``step_seed``), from a generator of its own seeded by the step the iterator starts at
    (:class:`StepKeyedWorkerSeeds`).

    Raises:
        TypeError: the loader's dataset has no ``__len__`` (iterable datasets cannot be Poisson-sampled).
    """
    dataset = loader.dataset if dataset is None else dataset
    collate_fn = loader.collate_fn if collate_fn is None else collate_fn
    if not hasattr(dataset, "__len__"):
        raise TypeError("Poisson sampling needs a map-style dataset with __len__; got an iterable dataset")
    sampler = sampler_class(
        len(dataset),
        sample_rate,
        num_steps=num_steps,
        micro_batches=micro_batches,
        generator=generator,
        rank=rank,
        world_size=world_size,
        lengths=lengths,
    )
    options: dict[str, Any] = {
        "batch_sampler": sampler if wrap_sampler is None else wrap_sampler(sampler),
        "collate_fn": collate_fn
        if isinstance(collate_fn, EmptyBatchCollate) and collate_fn.dataset is dataset
        else EmptyBatchCollate(collate_fn, dataset),
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "worker_init_fn": loader.worker_init_fn,
        "persistent_workers": loader.persistent_workers if loader.num_workers > 0 else False,
        "timeout": loader.timeout,
        "multiprocessing_context": loader.multiprocessing_context if loader.num_workers > 0 else None,
        "prefetch_factor": loader.prefetch_factor if loader.num_workers > 0 else None,
        "pin_memory_device": loader.pin_memory_device,
    }
    if sampler.step_seed is None:
        return DataLoader(dataset, generator=loader.generator, **options)
    return StepKeyedWorkerSeeds(dataset, step_seed=functools.partial(_worker_seed, sampler), **options)


def _worker_seed(sampler: PoissonBatchSampler) -> int:
    """The seed of the workers' base seed of an iterator starting at the sampler's next step (one stream per step,
    apart from the batches')."""
    assert sampler.step_seed is not None and sampler.next_step is not None  # keyed by the step: both given
    return derive_seed(sampler.step_seed(sampler.next_step()), "worker seeds")


class StepKeyedWorkerSeeds(DataLoader):
    """A ``DataLoader`` whose new iterators draw their workers' base seed from a generator of its own, seeded by
    ``step_seed()`` as the iterator starts, never from torch's global generator (which dropout draws from): with
    ``exact_resume`` a resumed run leaves the global generator where the checkpoint restored it, and its workers are
    seeded as the uninterrupted run's were when both start an epoch at the same step (``persistent_workers`` keep the
    first iterator's seed).

    Args:
        args, kwargs: ``DataLoader``'s, without ``generator``.
        step_seed: the seed of the next iterator's generator.
    """

    def __init__(self, *args: Any, step_seed: Callable[[], int], **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "generator": torch.Generator()})
        self._step_seed = step_seed

    def __iter__(self) -> Any:
        """Reseed the workers' generator, then iterate as ``DataLoader`` does."""
        assert self.generator is not None  # set by __init__
        self.generator.manual_seed(self._step_seed())
        return super().__iter__()
