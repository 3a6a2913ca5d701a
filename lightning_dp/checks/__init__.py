"""Checks around the training forward for leaks the clipping hooks cannot see (docs/design.md section 9).

Per-sample clipping bounds each example's influence on the GRADIENT. What escapes it is checked at run time:

- state written during the forward without noise (a buffer or frozen parameter updated from the data):
  :mod:`~lightning_dp.checks.buffers` (:class:`BufferWatch`);
- operations that mix examples: with a gradient path :mod:`~lightning_dp.checks.independence`
  (:func:`check_batch_independence`), without one :mod:`~lightning_dp.checks.leave_half_out`
  (:func:`check_leave_half_out`);
- :mod:`~lightning_dp.checks.guard` (:class:`TrainingGuard`) runs them around each training forward of a run.
"""

from lightning_dp.checks.buffers import BufferWatch
from lightning_dp.checks.guard import TrainingGuard, validate_independence_every
from lightning_dp.checks.independence import BatchMixingError, check_batch_independence, input_leaves
from lightning_dp.checks.leave_half_out import check_leave_half_out

__all__ = [
    "BatchMixingError",
    "BufferWatch",
    "TrainingGuard",
    "check_batch_independence",
    "check_leave_half_out",
    "input_leaves",
    "validate_independence_every",
]
