"""``noise_correlation='banded'`` (and ``'blt'``) on 2 CPU processes (gloo) through ``DPDDPStrategy``, launched as
``ddp_fit_script.py --banded B`` (docs/design.md sections 5.1 and 8): every rank holds the same partition (keyed by a
stream seed of the agreed base seed), every step's examples on both ranks come from group ``step mod b`` and from the
rank's shard, every rank joins every step (an empty local batch included), the ranks stay bit-identical (the same
``Z_t`` and the same ``C^{-1}`` stream on every rank, added to the all-reduced clipped sum), and at ``q_b = 1`` (each
step samples its whole group, so the union of the ranks' batches is the one-process batch) the run equals the
one-process run of the same seed."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from helpers import BatchIndexRecorder, TinyRegressor, make_trainer
from process_helpers import fit_on_two_processes

from lightning_dp import DPStrategy
from lightning_dp.correlated_noise.workloads import Workload
from lightning_dp.engine.correlation import plan_correlation
from lightning_dp.engine.noise_setup import NoiseSetup
from lightning_dp.mechanisms.gaussian import GaussianMechanism

WORLD = 2


def _script_strategy(**options) -> DPStrategy:
    """The one-process ``DPStrategy`` with ddp_fit_script.py's noise multiplier (1) and bound (0.5), and ``options``."""
    return DPStrategy(noise_multiplier=1.0, max_grad_norm=0.5, **options)


def _check_groups(ranks: list[dict], band: int) -> None:
    """The ranks' partitions are equal; at step t each rank's examples are of its shard and of group t mod b."""
    groups = ranks[0]["groups"]
    assert groups is not None and all(torch.equal(rank["groups"], groups) for rank in ranks)
    assert len(set(groups.tolist())) == band  # 64 examples: every group non-empty
    steps = {len(rank["batches"]) for rank in ranks}
    assert steps == {6}, "every rank joins every step"
    for rank, record in enumerate(ranks):
        for t, batch in enumerate(record["batches"]):
            assert all(i % WORLD == rank for i in batch)
            assert set(groups[batch].tolist()) <= {t % band}


def _identical(ranks: list[dict]) -> None:
    a, b = ranks
    assert a["steps"] == b["steps"] == 6 and a["ledger"] == b["ledger"]
    assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"], strict=True))
    assert any(not torch.equal(p, start) for p, start in zip(a["params"], a["initial"], strict=True))


def test_two_processes_equal_one_process_at_group_rate_one(tmp_path):
    """b = 2, q = 1/2: q_b = 1, so step t's union over the ranks is ALL of group t mod 2 and the one-process run of
    the same seed takes the same batches; its noise (rank 0 keeps the one-process streams) and its epsilon too."""
    ranks = fit_on_two_processes(tmp_path, "--banded", "2", "--sample-rate", "0.5", "--seed", "0")
    _identical(ranks)
    _check_groups(ranks, band=2)
    groups = ranks[0]["groups"]
    for t in range(6):
        union = sorted(ranks[0]["batches"][t] + ranks[1]["batches"][t])
        assert union == (groups == t % 2).nonzero().flatten().tolist()

    single = _script_strategy(seed=0, sample_rate=0.5, noise_correlation="banded", correlation_band=2)
    torch.manual_seed(0)
    module = TinyRegressor(batch_size=8 * WORLD)
    recorder = BatchIndexRecorder(module.data.tensors[0])
    make_trainer(single, max_steps=6, callbacks=[recorder]).fit(module)
    assert recorder.batches == [sorted(a + b) for a, b in zip(ranks[0]["batches"], ranks[1]["batches"], strict=True)]
    engine = single.privacy_engine
    for rank in ranks:
        assert rank["epsilon"] == pytest.approx(engine.epsilon(), rel=1e-12)
        assert rank["summary"]["correlation_band"] == 2 and rank["summary"]["group_sample_rate"] == 1.0
        for got, want in zip(rank["params"], module.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach())  # float32: the all-reduce only reorders the sum


def test_blt_on_two_processes_equals_one_process(tmp_path):
    """``noise_correlation='blt'`` with 2 buffers at q = 1/2: b = floor(1 / q) = 2 groups sampled whole (q_b = 1), so
    the ranks' union is the one-process batch; the BLT stream is the same on both ranks, and parameters and epsilon
    equal the one-process run of the same seed."""
    ranks = fit_on_two_processes(tmp_path, "--blt", "2", "--sample-rate", "0.5", "--seed", "0")
    _identical(ranks)
    _check_groups(ranks, band=2)
    single = _script_strategy(seed=0, sample_rate=0.5, noise_correlation="blt", correlation_buffers=2)
    torch.manual_seed(0)
    module = TinyRegressor(batch_size=8 * WORLD)
    make_trainer(single, max_steps=6).fit(module)
    engine = single.privacy_engine
    assert engine.summary()["noise_correlation"] == "blt"
    for rank in ranks:
        assert rank["ledger"] == engine.accountant.state_dict()
        assert rank["epsilon"] == pytest.approx(engine.epsilon(), rel=1e-12)
        for got, want in zip(rank["params"], module.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach())


def test_two_processes_sample_their_shards_of_the_steps_group(tmp_path):
    """b = 4, q = 0.01: q_b = 0.04, random batches, most of them empty on a rank (seed 1: some examples drawn, and
    local batches of 0, 1 and 2 examples); only group t mod 4 at step t, each rank from its shard, every rank joins
    all 6 steps, the ranks stay identical, and the accounting is the one-process run's (the same q, b and steps)."""
    ranks = fit_on_two_processes(tmp_path, "--banded", "4", "--sample-rate", "0.01", "--seed", "1")
    _identical(ranks)
    _check_groups(ranks, band=4)
    sizes = {len(batch) for rank in ranks for batch in rank["batches"]}
    assert 0 in sizes and len(sizes) > 1, sizes
    single = _script_strategy(seed=1, sample_rate=0.01, noise_correlation="banded", correlation_band=4)
    make_trainer(single, max_steps=6).fit(TinyRegressor())
    assert ranks[0]["epsilon"] == pytest.approx(single.privacy_engine.epsilon(), rel=1e-12)


def test_a_resume_on_two_processes_is_the_one_process_resume(tmp_path):
    """b = 2, q_b = 1, one epoch then a resume for a second: both ranks restart the correlation as segment 1 (no
    noise state in the checkpoint), stay identical and keep sampling group ``step mod b``; parameters, ledger and
    epsilon equal the one-process run resumed from its own checkpoint of the same seed."""
    options = ["--banded", "2", "--sample-rate", "0.5", "--seed", "0"]
    first = fit_on_two_processes(tmp_path / "first", *options, "--max-epochs", "1")
    (ckpt,) = (tmp_path / "first" / "ckpt").glob("*.ckpt")
    ranks = fit_on_two_processes(tmp_path / "resumed", *options, "--max-epochs", "2", "--resume", str(ckpt))
    a, b = ranks
    per_epoch = first[0]["steps"]
    assert per_epoch >= 2 and a["steps"] == b["steps"] == 2 * per_epoch and a["ledger"] == b["ledger"]
    assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"], strict=True))
    assert all(torch.equal(rank["groups"], a["groups"]) for rank in ranks)
    for rank, record in enumerate(ranks):  # the resumed run's steps: global steps per_epoch ... 2 per_epoch - 1
        for t, batch in enumerate(record["batches"], start=per_epoch):
            assert all(i % WORLD == rank for i in batch) and set(a["groups"][batch].tolist()) <= {t % 2}

    def single(max_epochs: int, ckpt_path=None):
        strategy = _script_strategy(seed=0, sample_rate=0.5, noise_correlation="banded", correlation_band=2)
        torch.manual_seed(0)
        module = TinyRegressor(batch_size=8 * WORLD)
        trainer = make_trainer(strategy, max_epochs=max_epochs)
        trainer.fit(module, ckpt_path=ckpt_path)
        return trainer, strategy, module

    trainer, _, _ = single(1)
    trainer.save_checkpoint(tmp_path / "single.ckpt")
    _, strategy, module = single(2, tmp_path / "single.ckpt")
    engine = strategy.privacy_engine
    segments = [(event.segment, count) for event, count in engine.accountant.ledger]
    assert segments == [(0, per_epoch), (1, per_epoch)]
    assert a["ledger"] == engine.accountant.state_dict()
    assert a["epsilon"] == pytest.approx(engine.epsilon(), rel=1e-12)
    for got, want in zip(a["params"], module.parameters(), strict=True):
        torch.testing.assert_close(got, want.detach())


class _RankOne:
    """Rank 1's view of the collectives: rank 0's broadcast values differ from its own in the last bits (another
    machine); the start-of-training checks of the plan's settings pass."""

    def check_identical(self, what: str, value: object) -> None:
        pass

    def broadcast_object(self, value: dict) -> dict:
        if "coefs" in value:  # a banded strategy (its first coefficient is 1 by definition)
            return {**value, "coefs": [value["coefs"][0]] + [c * (1 + 1e-15) for c in value["coefs"][1:]]}
        return {key: v * (1 + 1e-15) if key == "noise_multiplier" else v for key, v in value.items()}


def test_every_rank_adopts_rank_zeros_strategy_and_calibrated_noise():
    """Each rank optimises ``C`` and calibrates sigma; one whose results end a last bit away from rank 0's adopts rank
    0's coefficients and noise multiplier, so the ranks add the same noise and account for it alike (in-process, with
    rank 1's collectives faked); rank 0 keeps its own."""
    plan = functools.partial(
        plan_correlation,
        "banded",
        band=4,
        buffers=None,
        sample_rate=0.1,
        planned_steps=20,
        segment=0,
        workload=Workload(20, momentum=0.9),
    )
    mine = plan(restored=None)
    setup = NoiseSetup(SimpleNamespace(distributed=_RankOne()), None, None)
    adopted = setup._rank_zeros_plan(plan, None)
    assert adopted.checkpoint_entry() == _RankOne().broadcast_object(mine.checkpoint_entry()) != mine.checkpoint_entry()
    assert adopted.workload == mine.workload and adopted.segment == 0
    noise = GaussianMechanism(0.8123, 1.0)
    assert setup._rank_zeros_noise(noise).noise_multiplier == 0.8123 * (1 + 1e-15) != noise.noise_multiplier
    rank_zero = NoiseSetup(
        SimpleNamespace(
            distributed=SimpleNamespace(check_identical=lambda *_: None, broadcast_object=lambda value: value)
        ),
        None,
        None,
    )
    assert rank_zero._rank_zeros_plan(plan, None).checkpoint_entry() == mine.checkpoint_entry()
    assert rank_zero._rank_zeros_noise(noise) is noise
