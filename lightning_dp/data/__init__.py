"""Data utilities: Poisson sampling with empty-batch support."""

from lightning_dp.data.poisson import EmptyBatchCollate, PoissonBatchSampler, poisson_dataloader

__all__ = ["EmptyBatchCollate", "PoissonBatchSampler", "poisson_dataloader"]
