"""An empty Poisson draw collates to zero-row tensors of the data's structure (docs/design.md section 2.2): dataclass
batches were passed whole, so every empty draw trained ``dataset[0]`` as if it were drawn (found in review)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.data import TensorDataset

from lightning_dp.data import EmptyBatchCollate


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor
    name: str = "pair"


def _pairs(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> Pair:
    return Pair(torch.stack([x for x, _ in rows]), torch.stack([y for _, y in rows]))


class Opaque:
    """A batch class whose tensors no collection walk sees."""

    def __init__(self, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.rows = rows


DATA = TensorDataset(torch.randn(5, 3), torch.randn(5))


def test_an_empty_draw_of_dataclass_batches_has_zero_rows() -> None:
    empty = EmptyBatchCollate(_pairs, DATA)([])
    assert isinstance(empty, Pair) and empty.x.shape == (0, 3) and empty.y.shape == (0,) and empty.name == "pair"
    assert EmptyBatchCollate(_pairs, DATA)([DATA[1], DATA[2]]).x.shape == (2, 3)


def test_0_dim_tensors_are_kept_and_structures_rebuilt() -> None:
    def with_scale(rows: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {"x": torch.stack([x for x, _ in rows]), "scale": torch.tensor(2.0)}

    empty = EmptyBatchCollate(with_scale, DATA)([])
    assert empty["x"].shape == (0, 3) and empty["scale"].shape == ()


def test_batches_whose_tensors_cannot_be_cut_are_refused_when_the_loader_is_built() -> None:
    with pytest.raises(ValueError, match="no tensor that lightning_dp can cut to zero rows"):
        EmptyBatchCollate(Opaque, DATA)
