"""One triangle of each sample's Gram matrix ``x_b x_b^T`` from BLAS's symmetric rank-k update, on the CPU.

``torch.bmm`` has no symmetric product: it forms both triangles, twice the multiply-adds. scipy's ``?syrk`` forms one
(docs/design.md section 12.6).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from scipy.linalg import blas
from threadpoolctl import ThreadpoolController

from lightning_dp.clipping.rows import takes_cpu_paths

#: ``?syrk`` of each dtype it takes.
_SYRK = {torch.float32: blas.ssyrk, torch.float64: blas.dsyrk}


def has_triangle_gram(x: torch.Tensor) -> bool:
    """Whether :func:`triangle_gram` takes ``x``: a float32 or float64 tensor where the library takes its CPU paths
    (:func:`~lightning_dp.clipping.rows.takes_cpu_paths`)."""
    return takes_cpu_paths(x) and x.dtype in _SYRK


@functools.cache
def _blas_controller() -> ThreadpoolController:
    """The BLAS libraries loaded (scipy's among them), found once."""
    return ThreadpoolController()


def triangle_gram(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, T]``: ``x_b x_b^T`` for each sample of ``x`` ``[B, T, n]`` (:func:`has_triangle_gram`), its lower
    triangle and diagonal filled and the entries above the diagonal 0, from one ``?syrk`` per sample (scipy's BLAS,
    with as many threads as torch's intra-op threads): half the multiply-adds of ``torch.bmm(x, x.transpose(1, 2))``.

    Raises:
        TypeError: ``x`` is not float32 or float64.
    """
    syrk = _SYRK.get(x.dtype)
    if syrk is None:
        raise TypeError(f"triangle_gram takes float32 or float64, not {x.dtype}")
    rows = x.detach().resolve_neg().contiguous()
    out = x.new_zeros(x.shape[0], x.shape[1], x.shape[1])
    # named for torch's profiler, which sees no operator in BLAS's work
    with (
        torch.profiler.record_function("lightning_dp::triangle_gram"),
        _blas_controller().limit(limits=torch.get_num_threads(), user_api="blas"),
    ):
        for sample, gram in zip(rows.numpy(), out.numpy(), strict=True):
            # column-major views: sample.T is [n, T], so trans=1 forms sample sample^T; syrk's upper triangle of
            # gram.T is the lower triangle of gram, written in place (beta = 0 reads nothing of it)
            result = syrk(1.0, sample.T, trans=1, c=gram.T, overwrite_c=1)
            if not np.shares_memory(result, gram):  # scipy copied c: its copy holds the triangle
                gram.T[...] = result
    return out
