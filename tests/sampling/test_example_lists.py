"""Per-example entries that are not a tensor's rows (a tuple of names from ``default_collate``, a list of per-example
spans) are selected with their rows wherever the engine selects examples (lightning_dp/data/example_lists.py): they
were passed whole to every part under ``max_physical_batch_size``, to the leave-half-out halves and, from
``dataset[0]``, to an empty draw, so a step reading them failed, or read another example's entry, only at the draws that
are cut (found in review). Where they are is decided once, from ``dataset[0]``, never from a draw (found in review of
a first version that looked at each batch's entries)."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
from helpers import TinyRegressor, make_trainer, regression_data
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from lightning_dp import DPStrategy, augment_each_example, repeat_for_multiplicity
from lightning_dp.checks.leave_half_out import check_leave_half_out
from lightning_dp.data import EmptyBatchCollate
from lightning_dp.data.example_lists import ExampleList, ExampleTuple
from lightning_dp.data.physical_batches import split_rows
from lightning_dp.data.users import UserCollate, UserDataset, flatten_users
from lightning_dp.engine.privacy_engine import PrivacyEngine

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
    """Each example's squared error times a weight read from its name; records every pass's rows and names."""

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


class Spans(Dataset):
    """Per-example entries whose kind varies: a span ``(start, end)`` or ``None``, and a list of tags, mostly empty."""

    spans = [None, (3, 5), None, (7, 9)]
    tags: list[list[str]] = [[], ["a", "b"], [], []]

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict:
        return {"x": torch.full((2,), float(index)), "span": self.spans[index], "tags": self.tags[index]}


def _spans(rows: list[dict]) -> dict:
    return {
        "x": torch.stack([r["x"] for r in rows]),
        "span": [r["span"] for r in rows],
        "tags": [r["tags"] for r in rows],
    }


@pytest.mark.parametrize("drawn", [[0, 2], [0, 1], [1, 3], [2, 1, 3]])
def test_what_is_marked_does_not_depend_on_the_draws_entries(drawn) -> None:
    """A first version decided per batch from the entries' kinds: example 1's span ``(3, 5)`` was taken for a list
    of two examples at draws holding example 1, and its tags switched the marking off."""
    collate = EmptyBatchCollate(_spans, Spans())
    batch = collate([Spans()[i] for i in drawn])
    assert isinstance(batch["span"], ExampleList) and isinstance(batch["tags"], ExampleList)
    parts = split_rows(batch, len(drawn), cap=1)
    assert [part["span"] for part in parts] == [[Spans.spans[i]] for i in drawn]
    assert [part["tags"] for part in parts] == [[Spans.tags[i]] for i in drawn]
    assert [int(part["x"][0, 0]) for part in parts] == drawn


def test_lists_keep_their_type_and_leave_half_out_selects_their_entries() -> None:
    def listed(rows):
        return torch.stack([x for x, _, _ in rows]), torch.stack([y for _, y, _ in rows]), [n for _, _, n in rows]

    batch = EmptyBatchCollate(listed, Named())([Named()[i] for i in range(4)])
    assert isinstance(batch[2], ExampleList)
    seen: list[tuple[str, ...]] = []

    def loss(b):
        x, _, names = b
        seen.append(tuple(names))
        assert type(names) is ExampleList and len(names) == len(x)
        return x.sum(1) * torch.tensor([weight(name) for name in names])

    assert check_leave_half_out(loss, batch, 4, torch.nn.Linear(1, 1))
    assert ("example-0", "example-2") in seen and ("example-1", "example-3") in seen
    assert ("example-0", "example-0", "example-2", "example-2") in seen  # each odd row a copy of the even one


class Tagged(Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> dict:
        return {"x": torch.full((2,), float(index)), "name": f"ex{index}"}


@pytest.mark.parametrize("k", [1, 2])
def test_user_batches_group_the_names_by_user_and_never_a_shared_list(k) -> None:
    """A first version grouped every list of ``U K`` entries: a shared list of two class names was split between the
    users at the draws of ``U K = 2`` rows, and with ``K = 2`` taken for a per-example list for the whole run."""

    def collate(rows: list[dict]) -> dict:
        batch = default_collate(rows)
        batch["classes"] = ["neg", "pos"]
        return batch

    users = UserDataset(Tagged(), [0, 0, 1, 1, 2, 2], examples_per_user=k)
    loader_collate = EmptyBatchCollate(UserCollate(collate, users), users)
    for drawn in ([], [0], [0, 1], [0, 1, 2]):
        batch = loader_collate([users[u] for u in drawn])
        rows, _ = flatten_users(batch)
        assert rows["classes"] == ["neg", "pos"] and rows["x"].shape[0] == len(drawn) * k
        assert list(rows["name"]) == [f"ex{int(x)}" for x in rows["x"][:, 0]]
        for part in split_rows(batch, len(drawn), cap=1):
            part_rows, _ = flatten_users(part)
            assert part_rows["classes"] == ["neg", "pos"]
            assert list(part_rows["name"]) == [f"ex{int(x)}" for x in part_rows["x"][:, 0]]


def test_augmentation_copies_repeat_the_names_and_augment_each_example_gets_its_own() -> None:
    batch = EmptyBatchCollate(None, Named())([Named()[i] for i in (1, 2)])
    rows = repeat_for_multiplicity(batch, 2)
    assert rows[0].shape[0] == 4 and rows[2] == ("example-1", "example-1", "example-2", "example-2")
    seen = []

    def augment(piece):
        x, y, names = piece
        seen.append(tuple(names))
        return x + 1, y, names

    x, _, names = augment_each_example(rows, 2, augment)
    assert seen == [(), ("example-1", "example-1"), ("example-2", "example-2")]  # zero copies first, at every draw
    assert names == rows[2] and isinstance(names, ExampleTuple) and torch.equal(x, rows[0] + 1)


def test_a_collator_that_changes_its_examples_and_a_fast_tokenizers_batch_are_kept() -> None:
    """The collates at construction take fresh examples (HF's multiple-choice collator pops ``label``); marking changes
    a mapping in place, so a ``BatchEncoding`` keeps its encodings (a first version rebuilt every batch)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def popping(features: list[dict]) -> dict:
        labels = [feature.pop("label") for feature in features]
        return {"x": torch.stack([f["x"] for f in features]), "labels": torch.tensor(labels)}

    class Labelled(Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> dict:
            return {"x": torch.full((2,), float(index)), "label": index % 2}

    assert EmptyBatchCollate(popping, Labelled())([]).get("labels").shape == (0,)
    stored = [{"x": torch.full((2,), float(index)), "label": index % 2} for index in range(4)]  # returned as stored
    EmptyBatchCollate(popping, stored)([])
    assert all("label" in example for example in stored)

    vocabulary = {"[PAD]": 0, "[UNK]": 1, "hello": 2, "world": 3}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]")
    texts = ["hello world", "world", "hello"]

    def tokenize(rows: list[str]):
        encoding = tokenizer(list(rows), return_tensors="pt", padding=True)
        encoding["text"] = list(rows)
        return encoding

    batch = EmptyBatchCollate(tokenize, texts)(texts[:2])
    assert isinstance(batch["text"], ExampleList) and batch.is_fast and batch.word_ids(0) == [0, 1]


class Tokens(Dataset):
    """Per-example token tensors of 4 entries in a list (as a collate of variable-length tensors gives them)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict:
        return {"x": torch.full((2,), float(index)), "tokens": torch.arange(4) + 10 * index}


def _token_lists(rows: list[dict]) -> dict:
    return {"tokens": [r["tokens"] for r in rows], "x": torch.stack([r["x"] for r in rows])}


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_the_tensors_inside_a_marked_list_are_never_taken_for_rows(size) -> None:
    """The copies, the augmentation pieces and the independence check's inputs looked inside marked lists (found in
    review): with per-example tensors of 4 entries, ``repeat_for_multiplicity`` raised at 3 examples and not at 4, and
    ``augment_each_example`` swapped ``x`` for a list's tensor at 1 example."""
    from lightning_dp.checks.independence import input_leaves

    batch = EmptyBatchCollate(_token_lists, Tokens())([Tokens()[i] for i in range(size)])
    rows = repeat_for_multiplicity(batch, 2)
    assert len(rows["tokens"]) == rows["x"].shape[0] == 2 * size
    out = augment_each_example(rows, 2, lambda piece: {"tokens": piece["tokens"], "x": piece["x"] + 100})
    assert torch.equal(out["x"], rows["x"] + 100) and all(
        torch.equal(a, b) for a, b in zip(out["tokens"], rows["tokens"], strict=True)
    )
    _, leaves = input_leaves({"tokens": ExampleList([torch.zeros(4) for _ in range(size)]), "x": batch["x"]}, size)
    assert list(leaves) == ["input 0"] and leaves["input 0"].shape == (size, 2)


@pytest.mark.parametrize("k", [1, 2])
def test_user_level_leaves_the_tensors_inside_per_row_lists_as_they_are(k) -> None:
    """``UserCollate`` reshaped every tensor of ``U K`` entries, those inside the per-row lists too (found in review):
    4-token rows became ``[2, 2]`` at the draws of ``U K = 4`` rows only."""
    users = UserDataset(Tokens(), [0, 0, 1, 1, 2, 2, 3, 3], examples_per_user=k)
    collate = EmptyBatchCollate(UserCollate(_token_lists, users), users)
    for count in (1, 2, 3, 4):
        rows, _ = flatten_users(collate([users[u] for u in range(count)]))
        assert [tuple(t.shape) for t in rows["tokens"]] == [(4,)] * (count * k)


class Ragged(Dataset):
    """Token tensors of ``shortest`` to ``shortest + 2`` entries."""

    def __init__(self, size: int, shortest: int) -> None:
        self.size, self.shortest = size, shortest

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        return {"x": torch.full((2,), float(index)), "t": torch.arange(self.shortest + index % 3)}


def _stack_or_list(rows: list[dict]) -> dict:
    """Stacks the drawn examples' ``t`` when their shapes match, lists them otherwise."""
    tensors = [r["t"] for r in rows]
    same = len({t.shape for t in tensors}) == 1
    return {"x": torch.stack([r["x"] for r in rows]), "t": torch.stack(tensors) if same else tensors}


def test_a_list_where_dataset_0_stacks_a_tensor_is_marked_and_augment_copes_with_empty_draws() -> None:
    """A collate that stacks the drawn examples' tensors when their shapes match and lists them otherwise: the path is
    found from the stacked tensor (1 row, then 2), and the list marked at the draws that give one."""

    collate = EmptyBatchCollate(_stack_or_list, Ragged(6, shortest=1))
    batch = collate([Ragged(6, shortest=1)[i] for i in (0, 1, 2)])
    assert isinstance(batch["t"], ExampleList)
    assert [part["t"] for part in split_rows(batch, 3, cap=2)][1] == [batch["t"][2]]
    empty = collate([])
    assert empty["x"].shape == (0, 2) and empty["t"].shape[0] == 0
    assert augment_each_example(repeat_for_multiplicity(empty, 2), 2, lambda piece: piece)["x"].shape == (0, 2)


@pytest.mark.parametrize("size", [0, 1, 2, 3])
def test_augment_each_example_gets_one_examples_copies_when_only_lists_hold_them(size) -> None:
    """With no tensor of rows left outside the marked lists, ``augment_each_example`` called ``fn`` once on the whole
    batch, so an ``fn`` mixing "its" copies mixed examples, at the draws a stack-or-list collate listed (found in
    review); a list of another length than the rows' raised at some draws only."""
    rows = repeat_for_multiplicity({"t": ExampleList([torch.full((1 + i,), float(i)) for i in range(size)])}, 2)
    seen: list[int] = []

    def mix_copies(piece: dict) -> dict:
        seen.append(len(piece["t"]))
        if not piece["t"]:  # an empty draw's zero copies
            return piece
        return {"t": ExampleList([piece["t"][0] + piece["t"][-1]] * len(piece["t"]))}

    out = augment_each_example(rows, 2, mix_copies)
    assert seen == [0] + [2] * size  # zero copies first, at every draw
    assert [float(t[0]) for t in out["t"]] == [2.0 * i for i in range(size) for _ in range(2)]
    with pytest.raises(ValueError, match="every per-example list of B\\*K entries"):
        augment_each_example({"x": torch.zeros(2 * size + 2, 1), "t": ExampleList([0] * (2 * size))}, 2, mix_copies)


def test_a_random_first_example_and_the_hf_reading_of_the_size() -> None:
    """``dataset[0]`` is fetched once for the two set-up collates: with a random length, the collate of one example
    stacked a tensor and the collate of two fresh fetches listed two (found in review), so the list was not marked."""
    from lightning_dp.data.batch_tensors import leading_rows

    class RandomLength(Dataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> dict:
            return {"t": torch.zeros(int(torch.randint(1, 50, ()))), "label": index}

    def stack_or_list(rows: list[dict]) -> dict:
        tensors = [r["t"] for r in rows]
        same = len({t.shape for t in tensors}) == 1
        return {"t": torch.stack(tensors) if same else tensors, "label": [r["label"] for r in rows]}

    torch.manual_seed(0)
    collate = EmptyBatchCollate(stack_or_list, RandomLength())
    assert collate.example_paths == (("t",), ("label",))
    batch = collate([RandomLength()[i] for i in range(3)])
    assert leading_rows(batch) == 3 and leading_rows({"label": ExampleTuple((1, 2))}) == 2


def test_torch_pytrees_walk_marked_lists_and_keep_them_marked() -> None:
    from torch.utils import _pytree

    batch = {"t": ExampleList([torch.zeros(2), torch.ones(3)]), "names": ExampleTuple(("a", "b"))}
    doubled = _pytree.tree_map(lambda leaf: leaf.double() if isinstance(leaf, torch.Tensor) else leaf, batch)
    assert len(_pytree.tree_leaves(batch)) == 4 and doubled["t"][1].dtype == torch.float64
    assert isinstance(doubled["t"], ExampleList) and isinstance(doubled["names"], ExampleTuple)


def test_augment_each_example_runs_fn_on_an_empty_draw_too() -> None:
    """An empty draw passed its copies through without calling ``fn``, so a crop or a cast reached the model at the
    other draws only (found in review): ``fn`` now runs on the zero copies too; a batch with nothing to split into
    examples is refused rather than given to ``fn`` whole."""

    def crop(piece: dict) -> dict:
        return {"x": piece["x"][..., :28].float(), "y": piece["y"]}

    for size in (0, 1, 2):
        rows = repeat_for_multiplicity({"x": torch.zeros(size, 3, 32, dtype=torch.uint8), "y": torch.zeros(size)}, 2)
        out = augment_each_example(rows, 2, crop)
        assert out["x"].shape == (2 * size, 3, 28) and out["x"].dtype == torch.float32
    with pytest.raises(ValueError, match="no tensor of one dimension or more and no per-example list"):
        augment_each_example({"images": ["a", "b"]}, 1, lambda piece: piece)


def test_the_set_up_copies_of_dataset_0_are_cheap_and_never_fail() -> None:
    """``dataset[0]`` of a ``TensorDataset`` is a view of the whole data tensor, which a deep copy copied whole (found
    in review); a tensor that requires grad, or an entry that cannot be copied, made the copy raise."""

    from lightning_dp.data.example_lists import example_copy

    data = torch.zeros(1000, 64)
    copied = example_copy(TensorDataset(data)[0])
    assert copied[0].untyped_storage().nbytes() == 64 * 4 and copied[0].data_ptr() != data.data_ptr()
    grad = torch.ones(3, requires_grad=True) * 2
    assert not example_copy({"x": grad})["x"].requires_grad
    assert example_copy({"x": grad, "n": 3})["n"] == 3
    lock = threading.Lock()
    copied = example_copy({"x": torch.zeros(2), "lock": lock})
    assert copied["lock"] is lock  # what it cannot rebuild is kept, never a raise


@pytest.mark.parametrize("drawn", [[0], [0, 1], [0, 3]])
def test_augment_each_example_compares_what_fn_returns_with_what_it_was_given(drawn) -> None:
    """What a stack-or-list collate gives as a tensor at some draws and a marked list at others is held to the same
    rule (a crop of each sequence was refused at the stacking draws only: now accepted at every draw), and a renamed
    key, a new statistic of one example's copies or one written in place into a 0-dim tensor is refused at every draw
    (they were taken from one example's result for the whole batch; found in review)."""

    batch = EmptyBatchCollate(_stack_or_list, Ragged(4, shortest=4))([Ragged(4, shortest=4)[i] for i in drawn])
    rows = repeat_for_multiplicity(batch, 2)

    def crop(piece: dict) -> dict:
        tokens = piece["t"]
        cropped = tokens[:, :3] if isinstance(tokens, torch.Tensor) else ExampleList(t[:3] for t in tokens)
        return {"x": piece["x"], "t": cropped}

    cropped = augment_each_example(rows, 2, crop)
    assert all(len(t) == 3 for t in cropped["t"])

    def rename(piece: dict) -> dict:
        piece["pixels"] = -piece.pop("x")
        return piece

    def spread(piece: dict) -> dict:
        piece["scale"].copy_(piece["x"].mean())
        return piece

    for fn, given in (
        (lambda piece: {"pixels": piece["x"], "t": piece["t"]}, rows),
        (rename, rows),
        (lambda piece: {**piece, "scale": piece["x"].mean()}, rows),
        (spread, {**rows, "scale": torch.tensor(1.0)}),
    ):
        with pytest.raises(ValueError, match="the copies it was given, augmented"):
            augment_each_example(given, 2, fn)
    flipped = augment_each_example(rows, 2, lambda piece: {"x": -piece["x"], "t": piece["t"]})
    assert torch.equal(flipped["x"], -rows["x"])


def test_a_collator_normalising_in_place_never_changes_the_stored_first_example() -> None:
    """``example_copy`` kept numpy arrays by reference, so the set-up collates and every empty draw halved the stored
    ``dataset[0]`` (found in review): example 0's data then depended on how many draws were empty."""
    import numpy as np

    stored = [{"x": np.full(2, 8.0)} for _ in range(3)]

    def halving(samples: list[dict]) -> dict:
        for sample in samples:
            sample["x"] /= 2
        return {"x": torch.as_tensor(np.stack([sample["x"] for sample in samples]))}

    collate = EmptyBatchCollate(halving, stored)
    collate([])
    collate([])
    assert stored[0]["x"].tolist() == [8.0, 8.0]


def test_each_examples_fn_gets_its_own_0_dim_tensors() -> None:
    """A write through ``.data`` (which no version counter sees) into a shared 0-dim tensor passed one example's
    statistic to the next example's ``fn`` (found in review)."""
    stat = torch.tensor(0.0)
    rows = repeat_for_multiplicity({"x": torch.arange(3.0)[:, None], "stat": stat}, 2)
    read: list[float] = []

    def leaky(piece: dict) -> dict:
        read.append(float(piece["stat"]))
        if len(piece["x"]):
            piece["stat"].data.copy_(piece["x"].mean())
        return piece

    out = augment_each_example(rows, 2, leaky)
    assert read == [0.0, 0.0, 0.0, 0.0] and out["stat"] is stat and float(stat) == 0.0


def test_a_frozen_dataclass_example_is_copied() -> None:
    import dataclasses

    from lightning_dp.data.example_lists import example_copy

    @dataclasses.dataclass(frozen=True)
    class Frozen:
        x: torch.Tensor

    view = torch.zeros(100, 3)[5]
    copied = example_copy(Frozen(view))
    assert isinstance(copied, Frozen) and copied.x.untyped_storage().nbytes() == 3 * 4


def test_the_exact_fallback_refuses_a_marked_list_whatever_the_draw() -> None:
    """A per-example list passed whole to a fallback-served module's per-example reruns was accepted or refused by
    the data of the first batch that checked it (found in review): it is refused at every draw."""
    from torch import nn

    from lightning_dp.clipping import PerSampleClipper, UnsupportedModuleError

    class Context(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))

        def forward(self, x: torch.Tensor, context: list[torch.Tensor]) -> torch.Tensor:
            return x * self.weight + torch.tensor([float(c.sum()) for c in context]).reshape(-1, 1)

    for size in (0, 1, 3):
        model = Context()
        clipper = PerSampleClipper(model, max_grad_norm=1.0)
        context = ExampleList([torch.ones(2)] * size)
        with pytest.raises(UnsupportedModuleError, match="per-example list"):
            clipper.per_sample_norms(model(torch.randn(size, 4), context).sum(1))


def test_the_exact_fallback_takes_a_marked_list_as_one_input() -> None:
    """torch's pytrees walk marked lists: the fallback's record of a call would then hold the batch size and take
    the list's tensors for rows (found in review), so it keeps them as one input, as it did before."""
    from lightning_dp.clipping.layers.fallback import CapturedCall

    def signature(size: int):
        context = ExampleList([torch.randn(2 + i) for i in range(size)])
        return CapturedCall.record((torch.randn(size, 4),), {"context": context}, torch.zeros(size, 4)).signature

    assert signature(3) == signature(4)


def test_a_sharded_runs_stand_in_batch_is_marked_as_a_drawn_one() -> None:
    engine = PrivacyEngine(noise_multiplier=1.0, max_grad_norm=1.0)
    engine.training_loader(DataLoader(Named(), batch_size=8), batch_size=8, micro_batches=1)
    _, _, names = engine.stand_in_batch()
    assert isinstance(names, ExampleTuple) and names == ("example-0",)
    rows = repeat_for_multiplicity(engine.stand_in_batch(), 2)
    assert len(rows[2]) == rows[0].shape[0] == 2


def test_the_strategy_reads_the_batch_size_without_a_warning_naming_it() -> None:
    """Lightning's ``extract_batch_size`` warned on such batches with the size in the message, a new warning at each
    new size the draws gave (found with this file's tests)."""
    x = torch.zeros(5, 6)
    strategy = DPStrategy(noise_multiplier=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert strategy.read_batch_size((torch.tensor(2.0), x, ("a",) * 5)) == 5
        assert strategy.read_batch_size({"names": ["a"], "scale": torch.tensor(1.0)}) is None
        # a tensor's rows first, as the HF adapter reads them; a marked list's entries when there is no tensor
        assert strategy.read_batch_size((ExampleList([torch.zeros(3), torch.zeros(4)]), torch.zeros(2, 9))) == 2
        assert strategy.read_batch_size({"tokens": ExampleList([torch.zeros(3)] * 4), "scale": torch.tensor(1.0)}) == 4


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


class RebuiltAfterTransfer(WeightedByName):
    """Lowers the names in Lightning's ``on_after_batch_transfer``: a plain list, or one that keeps the mark."""

    def __init__(self, keep_mark: bool) -> None:
        super().__init__()
        self.keep_mark = keep_mark

    def on_after_batch_transfer(self, batch, dataloader_idx):
        x, y, names = batch
        lowered = [name.lower() for name in names]
        return x, y, ExampleList(lowered) if self.keep_mark else lowered


@pytest.mark.parametrize("cap", [None, 3])
def test_a_plain_list_a_hook_rebuilt_is_refused_at_every_batch_and_a_marked_one_trains(cap) -> None:
    """Such a list was passed whole to every capped pass, so the step failed or read another example's name at the
    draws above the cap only; it is refused at every batch (with or without a cap, empty draws included), and a hook
    that keeps the type trains as the uncapped run."""
    torch.manual_seed(0)
    strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=0.5, seed=1, max_physical_batch_size=cap)
    with pytest.raises(ValueError, match=r"plain list at \[2\].*a hook rebuilt it"):
        make_trainer(strategy, max_steps=2).fit(RebuiltAfterTransfer(keep_mark=False))
    modules = []
    for kept_cap in (None, 3):
        torch.manual_seed(0)
        module = RebuiltAfterTransfer(keep_mark=True)
        kept = DPStrategy(noise_multiplier=0.0, max_grad_norm=0.5, seed=1, max_physical_batch_size=kept_cap)
        make_trainer(kept, max_steps=4).fit(module)
        assert all(rows == names for rows, names in module.passes)
        modules.append(module)
    for a, b in zip(modules[0].parameters(), modules[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_plain_sequence_at_a_per_example_path_is_refused_whatever_it_holds_and_the_draw() -> None:
    """Refusing only lists of names let a hook's plain list of each example's tensors through, passed whole to every
    capped pass at the draws that were cut; marking whatever a hook left there passed a padded ``(ids, mask)`` tuple
    whole (both found in review). Any plain sequence there is refused, at every draw; a namedtuple is not one."""
    from collections import namedtuple

    from lightning_dp.data.example_lists import refuse_plain_sequences

    Padded = namedtuple("Padded", "ids mask")
    for collate, dataset, key in ((_token_lists, Tokens(), "tokens"), (_with_constant, Named(), "names")):
        loader_collate = EmptyBatchCollate(collate, dataset)
        assert (key,) in loader_collate.example_paths
        for drawn in ([], [0], [0, 1, 2]):
            batch = loader_collate([dataset[i] for i in drawn])
            refuse_plain_sequences(batch, loader_collate.example_paths)
            rows = torch.zeros(len(drawn), 3)
            for plain in (list(batch[key]), tuple(batch[key]), (rows, rows > 0)):
                with pytest.raises(ValueError, match=rf"plain (list|tuple) at \['{key}'\]"):
                    refuse_plain_sequences({**batch, key: plain}, loader_collate.example_paths)
            refuse_plain_sequences({**batch, key: Padded(rows, rows > 0)}, loader_collate.example_paths)
