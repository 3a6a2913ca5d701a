"""Data utilities: Poisson sampling with empty-batch support."""

from lightning_dp.data.poisson import EmptyBatchCollate, PoissonBatchSampler, poisson_dataloader, validate_sample_rate

__all__ = ["EmptyBatchCollate", "PoissonBatchSampler", "poisson_dataloader", "validate_sample_rate"]
