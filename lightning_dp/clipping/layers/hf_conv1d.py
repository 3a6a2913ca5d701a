"""Per-sample gradient terms for HuggingFace ``transformers.pytorch_utils.Conv1D`` (GPT-2's projections).

``Conv1D`` is a linear layer with a transposed weight: ``s = a W + b`` with ``W`` of shape ``[d_in, d_out]``, so
``grad W_i = A_i^T G_i`` and ``grad b_i = sum_t G_i[t]`` (Li et al. 2022, Section 4). Registered once
``transformers.pytorch_utils`` is imported (no model can hold a ``Conv1D`` before), so importing the clipping engines
does not import ``transformers``.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_dp.clipping.layers.linear import affine_terms
from lightning_dp.clipping.layers.registry import register_layer
from lightning_dp.clipping.terms import Term
from lightning_dp.utils.import_hooks import when_imported


def conv1d_terms(layer: nn.Module, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Term]:
    """Terms for ``weight`` ``[d_in, d_out]`` (factored ``A^T G``) and ``bias`` ``[d_out]`` (materialised)."""
    return affine_terms(layer, activation, output_grad, transposed_weight=True)


def _register_conv1d() -> None:
    from transformers.pytorch_utils import Conv1D

    register_layer(Conv1D)(conv1d_terms)


when_imported("transformers.pytorch_utils", _register_conv1d)
