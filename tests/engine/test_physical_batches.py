"""The parts of ``max_physical_batch_size``: its validation on every surface, cutting a batch into passes
(:func:`~lightning_dp.data.physical_batches.split_rows`), the passes of a micro-batch with the stand-in padding of a
sharded model (:func:`~lightning_dp.engine.physical_batches.physical_batches`), keeping the passes' sums apart from
``p.grad`` and the expected pass count of the start-up block. End to end: tests/adapters/test_physical_batch_cap*.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dp import DPStrategy
from lightning_dp.config import PrivacyConfig
from lightning_dp.data.physical_batches import expected_physical_batches, part_sizes, split_rows
from lightning_dp.data.poisson import PoissonBatchSampler
from lightning_dp.data.users import UserBatch
from lightning_dp.engine.physical_batches import (
    add_gradients,
    hold_gradients,
    physical_batches,
    run_physical_batches,
    swap_gradients,
)
from lightning_dp.engine.privacy_engine import PrivacyEngine
from lightning_dp.runtime.distributed import DistributedContext


@pytest.mark.parametrize("cap", [0, -3, 2.5, True, "4"])
def test_a_bad_cap_fails_at_construction_in_one_line_naming_the_option(cap) -> None:
    for build in (
        lambda: PrivacyConfig(noise_multiplier=1.0, max_physical_batch_size=cap),
        lambda: DPStrategy(noise_multiplier=1.0, max_physical_batch_size=cap),
    ):
        with pytest.raises(ValueError, match="max_physical_batch_size must be a whole number >= 1") as error:
            build()
        assert "\n" not in str(error.value)


def test_a_bad_cap_fails_when_the_hf_arguments_are_built() -> None:
    pytest.importorskip("transformers")
    from lightning_dp.hf import PrivacyArguments

    with pytest.raises(ValueError, match="max_physical_batch_size"):
        PrivacyArguments(noise_multiplier=1.0, max_physical_batch_size=0)
    assert PrivacyArguments(noise_multiplier=1.0, max_physical_batch_size=8).to_config().max_physical_batch_size == 8


def test_split_rows_slices_every_tensor_of_the_batch_size_and_keeps_the_others() -> None:
    x, y, scale = torch.arange(7 * 2).reshape(7, 2), torch.arange(7), torch.tensor([5.0, 6.0])
    parts = split_rows({"x": x, "nested": (y, scale), "name": "run"}, 7, 3)
    assert [len(part["x"]) for part in parts] == [3, 2, 2]
    assert torch.equal(torch.cat([part["nested"][0] for part in parts]), y)
    assert all(part["nested"][1] is scale and part["name"] == "run" for part in parts)  # not per example: repeated
    ((whole, _),) = split_rows((x, y), 7, 7)  # small enough: the batch itself
    assert whole is x
    assert split_rows((x[:0], y[:0]), 0, 3) == []


def test_split_rows_keeps_a_user_batch_and_cuts_between_users() -> None:
    batch = UserBatch(rows={"x": torch.randn(5, 4, 3)}, weights=torch.ones(5, 4))
    parts = split_rows(batch, 5, 2)
    assert all(isinstance(part, UserBatch) for part in parts)
    assert [tuple(part["rows"]["x"].shape) for part in parts] == [(2, 4, 3), (2, 4, 3), (1, 4, 3)]


@pytest.mark.parametrize("cap", [1, 2, 3, 4, 5, 8, 13])
def test_the_parts_are_as_equal_as_they_can_be_so_a_one_example_pass_needs_a_one_example_batch(cap) -> None:
    """A Poisson batch of ``size`` examples is cut into ``ceil(size / cap)`` parts whose sizes differ by at most one:
    cutting ``[cap, cap, ..., size mod cap]`` made a pass of one example whenever the draw was one above a multiple of
    the cap, so a training step that fails on one example (a ``.squeeze()``) raised at a step the draw chose."""
    for size in range(200):
        sizes = part_sizes(size, cap)
        assert sum(sizes) == size and len(sizes) == math.ceil(size / cap) and max(sizes, default=0) <= cap
        assert max(sizes, default=0) - min(sizes, default=0) <= 1
        if size > cap:
            assert min(sizes) >= math.ceil(cap / 2)
        if cap >= 3 and size > 1:
            assert min(sizes) >= 2
    assert part_sizes(16, 5) == [4, 4, 4, 4]


@pytest.mark.parametrize("size", [1, 9])
def test_split_rows_refuses_a_batch_without_per_example_tensors_whatever_its_size(size) -> None:
    with pytest.raises(ValueError, match="none of its tensors has the examples along its first dimension"):
        split_rows({"scalar": torch.tensor(1.0), "other": torch.zeros(size + 1)}, size, 4)


def _adapter(cap, *, sharded=False, ranks_max=None, stand_in=None):
    """A stand-in for an adapter and its engine: what physical_batches reads."""
    distributed = None if ranks_max is None else SimpleNamespace(max_over_ranks=lambda values: [ranks_max])
    engine = SimpleNamespace(
        config=SimpleNamespace(max_physical_batch_size=cap),
        every_rank_runs_every_step=sharded,
        distributed=distributed,
        stand_in_batch=lambda: stand_in,
        example_paths=(),
    )
    return SimpleNamespace(privacy_engine=engine, read_batch_size=lambda batch: len(batch[0]))


def test_passes_of_a_micro_batch() -> None:
    batch = (torch.randn(5, 2),)
    assert physical_batches(_adapter(None), batch) == [(batch, 5, False)]  # no cap: the micro-batch itself
    passes = physical_batches(_adapter(2), batch)
    assert [(size, stand_in) for _, size, stand_in in passes] == [(2, False), (2, False), (1, False)]
    empty = (torch.randn(0, 2),)
    assert physical_batches(_adapter(2), empty) == [(empty, 0, False)]  # one pass, as without a cap
    with pytest.raises(ValueError, match="cannot be read"):
        physical_batches(SimpleNamespace(**{**vars(_adapter(2)), "read_batch_size": lambda batch: None}), batch)


def test_a_sharded_rank_pads_to_the_largest_pass_count_with_stand_ins() -> None:
    one = (torch.randn(1, 2),)
    moved = []
    adapter = _adapter(2, sharded=True, ranks_max=4, stand_in=one)
    passes = physical_batches(adapter, (torch.randn(3, 2),), to_device=lambda b: moved.append(b) or b)
    assert [(size, stand_in) for _, size, stand_in in passes] == [(2, False), (1, False), (1, True), (1, True)]
    assert len(moved) == 2
    passes = physical_batches(adapter, (torch.randn(0, 2),))  # an empty batch: stand-ins only
    assert [stand_in for _, _, stand_in in passes] == [True] * 4


def test_run_clips_each_pass_before_the_next_forward_and_defers_the_last() -> None:
    events = []

    def forward(batch, size, stand_in):
        events.append(("forward", size))
        return torch.full((size,), float(size))

    def clip(loss, *, stand_in):
        events.append(("clip", len(loss)))
        return loss

    passes = [(None, 2, False), (None, 3, False), (None, 1, True), (None, 1, False)]
    done = run_physical_batches(passes, forward, clip, defer_last=True)
    clipped = [("forward", 2), ("clip", 2), ("forward", 3), ("clip", 3), ("forward", 1), ("clip", 1)]
    assert events == [*clipped, ("forward", 1)]  # the last pass's loss left to the framework's backward
    assert done.deferred is not None and len(done.deferred[0]) == 1 and done.deferred[1] is False
    assert done.count == 5 and float(done.loss_sum) == 2 * 2 + 3 * 3  # the stand-in left out
    assert float(done.mean("cpu")) == pytest.approx((4 + 9 + 1) / 6)
    done = run_physical_batches(passes[:3], forward, clip, defer_last=False)
    assert done.deferred is None and float(done.mean("cpu")) == pytest.approx(13 / 5)


def test_the_passes_sums_wait_apart_from_p_grad() -> None:
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    params[0].grad = torch.tensor([7.0, 7.0])  # e.g. the previous step's noisy gradient, zeroed later by Lightning
    held = hold_gradients(params)
    assert all(p.grad is None for p in params)
    params[0].grad = torch.tensor([1.0, 2.0])  # a pass's clipped sum
    sums = swap_gradients(params, held)
    assert torch.equal(params[0].grad, torch.tensor([7.0, 7.0])) and params[1].grad is None
    params[0].grad = None  # zero_grad
    params[1].grad = torch.ones(2)  # the last pass
    add_gradients(params, sums)
    assert torch.equal(params[0].grad, torch.tensor([1.0, 2.0])) and torch.equal(params[1].grad, torch.ones(2))


@pytest.mark.parametrize(("n", "q", "micro", "cap"), [(200, 0.1, 1, 7), (200, 0.1, 3, 4), (60, 0.5, 2, 3)])
def test_the_expected_pass_count_is_the_sampler_s(n, q, micro, cap) -> None:
    sampler = PoissonBatchSampler(n, q, num_steps=4000, micro_batches=micro, generator=torch.Generator().manual_seed(0))
    passes = [max(1, math.ceil(len(indices) / cap)) for indices in sampler]
    simulated = sum(passes) / 4000
    expected = expected_physical_batches(shard_size=n, sample_rate=q, micro_batches=micro, cap=cap)
    assert expected == pytest.approx(simulated, rel=0.02)
    assert expected_physical_batches(shard_size=n, sample_rate=1.0, micro_batches=2, cap=cap) == 2 * math.ceil(
        n / 2 / cap
    )
    assert expected_physical_batches(shard_size=n, sample_rate=q, micro_batches=2, cap=3, batch_size=7) == 2 * 3


def test_the_passes_of_a_micro_batch_share_one_slot_of_the_sum_check_schedule() -> None:
    """sum_check_every=2 counts micro-batches, not passes: which micro-batch is checked does not depend on how many
    passes the earlier ones' sizes needed (every pass of a due micro-batch is checked)."""
    from lightning_dp.clipping import PerSampleClipper

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    clipper = PerSampleClipper(model, max_grad_norm=1.0, sum_check_every=2)
    schedule = []
    for passes in ([3], [2, 2, 1], [4], [1, 1], [2]):
        clipper.start_batch()
        row = []
        for rows in passes:
            row.append(clipper._check_due())
            clipper.backward(model(torch.randn(rows, 3)).squeeze(1))
        schedule.append(row)
    assert schedule == [[True], [False, False, False], [True], [False, False], [True]]


class _OtherRankWithoutTheCap:
    """Rank 0's view of two ranks at the start of training, the other rank's options without the cap (its gather of
    the checked settings; the check itself is DistributedContext's)."""

    world_size, rank, is_main = 2, 0, True
    reduce_clipped_sum = any_rank = None
    check_identical = DistributedContext.check_identical

    def gather_objects(self, value: tuple) -> list[tuple]:
        return [value, (*value[:-1], None)]


def test_ranks_that_disagree_on_the_cap_are_refused_at_the_start_of_training() -> None:
    """A capped rank of a sharded model joins a MAX over the ranks' pass counts for every micro-batch, which an
    uncapped rank never joins: the ranks' collectives would pair up wrongly, so the cap is among the settings every
    rank must share."""
    model = torch.nn.Linear(3, 1)
    engine = PrivacyEngine(max_grad_norm=1.0, noise_multiplier=1.0, seed=3, max_physical_batch_size=4)
    engine.start_run(model, None)
    engine.training_loader(DataLoader(TensorDataset(torch.randn(16, 3)), batch_size=4), batch_size=4, micro_batches=1)
    engine.distributed = _OtherRankWithoutTheCap()
    disagree = r"ranks disagree on the .*max_physical_batch_size: \[\(16, .*4\), \(16, .*None\)\]"
    with pytest.raises(RuntimeError, match=disagree):
        engine.start_training([torch.optim.SGD(model.parameters(), lr=0.1)], total_steps=2)
