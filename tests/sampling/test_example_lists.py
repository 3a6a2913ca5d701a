"""Per-example entries that are not tensors (a list of names from ``default_collate``) are selected with their rows
wherever the engine selects examples (lightning_dp/data/example_lists.py): they were passed whole to every part under
``max_physical_batch_size``, to the leave-half-out halves and to an empty draw (``dataset[0]``'s entry), so a step
reading them failed, or read another example's entry, only at the draws that are cut (found in review)."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import TinyRegressor, make_trainer, regression_data
from torch.utils.data import Dataset, default_collate

from lightning_dp import DPStrategy, repeat_for_multiplicity
from lightning_dp.checks.leave_half_out import check_leave_half_out
from lightning_dp.data import EmptyBatchCollate
from lightning_dp.data.example_lists import ExampleList, ExampleTuple
from lightning_dp.data.physical_batches import split_rows
from lightning_dp.data.users import UserCollate, UserExamples, flatten_users

CLASSES = ["low", "mid", "high"]


class Named(Dataset):
    """``(x, y, name)``: the regression data with a name per example."""

    def __init__(self, n: int = 48) -> None:
        self.data = regression_data(n=n)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, str]:
        x, y = self.data[index]
        return x, y, f"example-{index}"


def weight(name: str) -> float:
    return 1.0 + int(name.split("-")[1]) % 3


class WeightedByName(TinyRegressor):
    """Each example's squared error times a weight read from its name; records whether every pass's names matched
    its rows."""

    def __init__(self) -> None:
        super().__init__(batch_size=16, data=Named())  # type: ignore[arg-type]
        self.passes: list[tuple[int, int]] = []

    def training_step(self, batch, batch_idx):
        x, y, names = batch
        if torch.is_grad_enabled():
            self.passes.append((len(x), len(names)))
        weights = torch.tensor([weight(name) for name in names])
        return weights * ((self.net(x) - y) ** 2).squeeze(-1)


def _with_constant(rows: list[tuple[torch.Tensor, torch.Tensor, str]]) -> dict:
    """A collate that adds a list shared by the batch (the class names) beside the per-example names."""
    x, y, names = default_collate(rows)
    return {"x": x, "y": y, "names": names, "classes": list(CLASSES)}


def test_per_example_names_are_marked_and_an_empty_draw_has_none() -> None:
    collate = EmptyBatchCollate(_with_constant, Named())
    batch = collate([Named()[i] for i in (4, 7, 9)])
    # default_collate gives the strings of a field as a tuple
    assert isinstance(batch["names"], ExampleTuple) and batch["names"] == ("example-4", "example-7", "example-9")
    assert type(batch["classes"]) is list  # the same length as the batch here, but not one entry per example
    empty = collate([])
    assert empty["x"].shape == (0, 6) and empty["names"] == () and isinstance(empty["names"], ExampleTuple)
    assert empty["classes"] == CLASSES


def test_the_cap_splits_the_names_with_their_rows_and_passes_a_shared_list_whole() -> None:
    batch = EmptyBatchCollate(_with_constant, Named())([Named()[i] for i in (4, 7, 9)])
    first, second = split_rows(batch, 3, cap=2)
    assert first["names"] == ("example-4", "example-7") and second["names"] == ("example-9",)
    assert first["classes"] == second["classes"] == CLASSES
    assert torch.equal(second["x"], batch["x"][2:])


def test_tuples_keep_their_type_and_leave_half_out_selects_their_entries() -> None:
    def listed(rows):
        return torch.stack([x for x, _, _ in rows]), torch.stack([y for _, y, _ in rows]), [n for _, _, n in rows]

    batch = EmptyBatchCollate(listed, Named())([Named()[i] for i in range(4)])
    assert isinstance(batch[2], ExampleList)
    seen: list[tuple[str, ...]] = []

    def loss(b):
        x, _, names = b
        seen.append(tuple(names))
        assert type(names) is ExampleList
        assert len(names) == len(x)
        return x.sum(1) * torch.tensor([weight(name) for name in names])

    assert check_leave_half_out(loss, batch, 4, torch.nn.Linear(1, 1))
    assert ("example-0", "example-2") in seen and ("example-1", "example-3") in seen
    assert ("example-0", "example-0", "example-2", "example-2") in seen  # each odd row a copy of the even one


def test_user_batches_group_the_names_by_user_and_flatten_them_back() -> None:
    data = Named()
    users = [UserExamples([data[0], data[1]], [0.5, 0.5]), UserExamples([data[2], data[2]], [1.0, 0.0])]
    batch = UserCollate(default_collate)(users)
    assert batch["rows"][2] == (("example-0", "example-1"), ("example-2", "example-2"))
    (first,) = [part["rows"][2] for part in split_rows(batch, 2, cap=1)[:1]]
    assert first == (("example-0", "example-1"),)
    rows, _ = flatten_users(batch)
    assert rows[2] == ("example-0", "example-1", "example-2", "example-2") and rows[0].shape == (4, 6)


def test_augmentation_copies_repeat_the_names() -> None:
    batch = EmptyBatchCollate(None, Named())([Named()[i] for i in (1, 2)])
    x, _, names = repeat_for_multiplicity(batch, 2)
    assert x.shape[0] == 4 and names == ("example-1", "example-1", "example-2", "example-2")


def test_the_strategy_reads_the_batch_size_without_a_warning_naming_it() -> None:
    """Lightning's ``extract_batch_size`` warned on such batches with the size in the message, a new warning at each
    new size the draws gave (found with this file's tests)."""
    x = torch.zeros(5, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert DPStrategy(noise_multiplier=1.0).read_batch_size((torch.tensor(2.0), x, ("a",) * 5)) == 5
        assert DPStrategy(noise_multiplier=1.0).read_batch_size({"names": ["a"], "scale": torch.tensor(1.0)}) is None


@pytest.mark.parametrize("noise", [0.0, 1.0])
def test_a_capped_run_reading_the_names_trains_as_the_uncapped_run(noise) -> None:
    """Before the fix every capped pass got all the batch's names: the weights did not broadcast against the pass's
    losses, at the draws above the cap only (and the first step's leave-half-out halves failed alike)."""
    modules = []
    for cap in (None, 3):
        torch.manual_seed(0)
        module = WeightedByName()
        strategy = DPStrategy(noise_multiplier=noise, max_grad_norm=0.5, seed=1, max_physical_batch_size=cap)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            make_trainer(strategy, max_steps=4).fit(module)
        assert not [w for w in caught if "batch size we found" in str(w.message)]
        assert all(rows == names for rows, names in module.passes)
        modules.append(module)
    plain, capped = modules
    assert max(rows for rows, _ in capped.passes) <= 3 < max(rows for rows, _ in plain.passes)
    for a, b in zip(plain.parameters(), capped.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
