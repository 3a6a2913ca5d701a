"""Data utilities: Poisson sampling with empty-batch support."""

from lightning_dp.data.example_lists import ExampleList, ExampleTuple
from lightning_dp.data.poisson import (
    EmptyBatchCollate,
    PoissonBatchSampler,
    expected_batch_sample_rate,
    poisson_dataloader,
    steps_per_epoch,
    validate_sample_rate,
)

__all__ = [
    "EmptyBatchCollate",
    "ExampleList",
    "ExampleTuple",
    "PoissonBatchSampler",
    "expected_batch_sample_rate",
    "poisson_dataloader",
    "steps_per_epoch",
    "validate_sample_rate",
]
