"""Checkpoints of ``noise_correlation='banded'``: the streaming state (noise) is never written, a resume restarts the
correlation as a new segment of the ledger, and the restarted (block-diagonal) strategy keeps the accountant's
conditions on ``C``."""

from __future__ import annotations

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers import TinyRegressor, make_trainer, regression_data
from torch.utils.data import TensorDataset

from lightning_dp import DPStrategy
from lightning_dp.accounting.banded_mf import BandedMFAccountant, BandedMFEvent, band_and_max_column_norm
from lightning_dp.correlated_noise import optimize_banded

BAND = 4


class _Groups(pl.Callback):
    """Checks that the batch of every optimizer step comes from group ``step mod b`` (the first input column of the
    data is the example's index)."""

    def __init__(self) -> None:
        self.steps_seen = 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        groups = trainer.train_dataloader.batch_sampler.groups
        indices = batch[0][:, 0].round().long()
        assert set(groups[indices].tolist()) <= {trainer.global_step % BAND}
        self.steps_seen += 1


def _indexed_data() -> TensorDataset:
    x, y = regression_data().tensors
    x[:, 0] = torch.arange(len(x), dtype=x.dtype)
    return TensorDataset(x, y)


def _fit(steps: int, ckpt_path=None, **options):
    strategy = DPStrategy(noise_multiplier=1.0, noise_correlation="banded", correlation_band=BAND, seed=0, **options)
    torch.manual_seed(0)
    groups = _Groups()
    trainer = make_trainer(strategy, max_steps=steps, callbacks=[groups])
    trainer.fit(TinyRegressor(batch_size=4, data=_indexed_data()), ckpt_path=ckpt_path)
    assert strategy.privacy_engine.steps == steps and groups.steps_seen > 0
    return trainer, strategy


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


def test_a_checkpoint_holds_the_strategy_but_no_noise_state(tmp_path):
    trainer, strategy = _fit(6)
    (optimizer,) = strategy.privacy_engine._optimizers  # the run's DPOptimizer
    state = [t for vector in optimizer.correlation.state_dict()["state"] for t in vector]
    assert len(state) == (BAND - 1) * 4 and all(t.abs().sum() > 0 for t in state)  # warm: b - 1 noise vectors
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    checkpoint = torch.load(tmp_path / "m.ckpt", weights_only=False)
    saved = list(_tensors(checkpoint))
    assert saved  # the model's weights
    for noise in state:
        assert not any(t.shape == noise.shape and torch.equal(t, noise) for t in saved)
    assert checkpoint["lightning_dp"]["noise_correlation"] == {
        "kind": "banded",
        "coefs": list(strategy.privacy_engine.state.correlation.strategy.coefs),
    }


def test_resume_restarts_the_correlation_as_a_new_segment(tmp_path):
    """Also: every step, before and after a resume mid-epoch and across an epoch's end (16 steps), samples its group."""
    trainer, first = _fit(6)
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    _, resumed = _fit(20, ckpt_path=tmp_path / "m.ckpt")
    engine = resumed.privacy_engine
    ledger = engine.accountant.ledger
    assert [(event.segment, count) for event, count in ledger] == [(0, 6), (1, 14)]
    assert engine.accountant.participations == 2 + 4  # ceil(6 / 4) + ceil(14 / 4)
    plan = engine.state.correlation
    assert plan.strategy == first.privacy_engine.state.correlation.strategy  # the checkpoint's coefficients
    (optimizer,) = resumed.privacy_engine._optimizers
    assert optimizer.correlation.step_index == 14  # a fresh stream: started at the resume
    event = BandedMFEvent(plan.column_norm, 4 * engine.sample_rate, BAND, plan.column_norm)
    expected = BandedMFAccountant().compose(event, 6)
    expected.compose(BandedMFEvent(**{**event.__dict__, "segment": 1}), 14)
    assert engine.epsilon() == expected.get_epsilon(engine.target_delta)
    assert "segment 1 (the correlation restarted)" in "\n".join(engine.startup_lines())


@pytest.mark.parametrize("cut", [1, 3, 5, 9])
def test_a_restart_keeps_the_band_and_the_column_norms(cut):
    """Restarting the stream at step ``cut`` replaces ``C`` by ``diag(C_cut, C_(n-cut))``: still lower triangular with
    band ``b`` and no column norm above ``s``, which is all the amplified accountant needs of ``C``."""
    n = 12
    strategy = optimize_banded(n, BAND, max_participations=1)
    dense = strategy.dense(n)
    restarted = np.zeros_like(dense)
    restarted[:cut, :cut] = strategy.dense(cut)
    restarted[cut:, cut:] = strategy.dense(n - cut)
    band, norm = band_and_max_column_norm(restarted, n)
    assert band == BAND and norm <= band_and_max_column_norm(dense, n)[1] + 1e-12


def test_a_checkpoint_of_independent_noise_does_not_resume_banded(tmp_path):
    strategy = DPStrategy(noise_multiplier=1.0, seed=0)
    trainer = make_trainer(strategy, max_steps=2)
    trainer.fit(TinyRegressor(batch_size=4))
    trainer.save_checkpoint(tmp_path / "m.ckpt")
    with pytest.raises(ValueError, match="trained with independent noise: resume with the same noise_correlation"):
        _fit(4, ckpt_path=tmp_path / "m.ckpt")


def test_a_second_fit_keeps_the_strategy_and_is_a_new_segment():
    """A second ``fit`` of the same trainer plans more steps: it keeps the first fit's ``C`` (so ``sigma``, ``q_b``,
    ``b`` and ``s`` stay the ledger's) and restarts the correlation as segment 1; a change the accountant refuses
    would be refused before any step."""
    trainer, strategy = _fit(6)
    engine = strategy.privacy_engine
    first = engine.state.correlation
    trainer.fit_loop.epoch_loop.max_steps = 20
    trainer.fit(trainer.lightning_module)
    assert (
        engine.state.correlation.strategy == first.strategy
        and engine.state.correlation.column_norm == first.column_norm
    )
    assert [(event.segment, count) for event, count in engine.accountant.ledger] == [(0, 6), (1, 14)]


def test_a_rebuilt_training_set_is_refused():
    """The groups are keyed by the examples' indices: a loader over another dataset object (a reordered Subset each
    epoch) could move an example to another group mid-run, so it is refused when built."""
    from torch.utils.data import DataLoader, Subset

    class Reshuffled(TinyRegressor):
        def train_dataloader(self):
            return DataLoader(Subset(self.data, torch.randperm(len(self.data)).tolist()), batch_size=4)

    strategy = DPStrategy(noise_multiplier=1.0, noise_correlation="banded", correlation_band=BAND, seed=0)
    trainer = make_trainer(strategy, max_epochs=2, reload_dataloaders_every_n_epochs=1)
    with pytest.raises(ValueError, match="must keep the same dataset object for the whole run"):
        trainer.fit(Reshuffled(batch_size=4, data=_indexed_data()))
    assert strategy.privacy_engine.steps > 0  # the first epoch ran; the second loader was refused
