"""Adaptive clipping through Lightning's checkpoints (the engine-level round trip is in test_adaptive_clipping.py):
a checkpoint written by ``ModelCheckpoint`` under ``DPStrategy`` carries the bound the run had reached, and a fresh
Trainer resumed from it clips (and noises) its first step at that bound, not at the initial ``max_grad_norm``.
Without noise and with fixed batches the resumed run is the uninterrupted run's second epoch, bound for bound."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import ClipBoundRecorder, TinyRegressor, make_trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dp import DPStrategy

INITIAL_BOUND = 0.5
STEPS_PER_EPOCH = 64 // 8  # TinyRegressor: 64 examples, batches (or expected batches) of 8
#: deterministic: no noise on the sum nor on the count, the loader's own fixed batches.
NOISE_FREE = dict(noise_multiplier=0.0, unclipped_num_std=0.0, poisson_sampling=False)
#: the usual run: noise on the sum and on the count (Theorem 1's split) and Poisson sampling, seeded.
NOISY = dict(noise_multiplier=1.0, unclipped_num_std=2.0, seed=0)


def _fit(max_epochs: int, options: dict, *, save_to: Path | None = None, ckpt_path: Path | None = None):
    """Fit TinyRegressor (the same initial parameters every time) with adaptive clipping, from ``ckpt_path`` if
    given, with a checkpoint at the end of every epoch in ``save_to`` if given; the bound of each step, the strategy
    and the module."""
    strategy = DPStrategy(max_grad_norm=INITIAL_BOUND, target_unclipped_quantile=0.5, **options)
    recorder = ClipBoundRecorder()
    callbacks = [recorder]
    if save_to is not None:
        callbacks.append(ModelCheckpoint(dirpath=save_to, every_n_epochs=1, save_top_k=-1))
    trainer = make_trainer(strategy, max_epochs=max_epochs, callbacks=callbacks, enable_checkpointing=bool(save_to))
    torch.manual_seed(0)
    module = TinyRegressor()
    trainer.fit(module, ckpt_path=ckpt_path)
    return recorder, strategy, module


def _first_epoch_checkpoint(out: Path) -> tuple[Path, float]:
    """The checkpoint written after the first epoch, and the adaptive bound it holds."""
    (ckpt,) = [path for path in out.iterdir() if "epoch=0" in path.name]
    state = torch.load(ckpt, weights_only=False)["lightning_dp"]
    return ckpt, state["adaptive_clipping"]["bound"]


def test_a_resumed_run_continues_from_the_checkpoints_bound_exactly(tmp_path) -> None:
    """Noise-free, so the run is deterministic: the resumed second epoch clips at the uninterrupted run's bounds,
    step for step, and ends at its bound and parameters."""
    full, full_strategy, full_module = _fit(2, NOISE_FREE, save_to=tmp_path)
    ckpt, saved = _first_epoch_checkpoint(tmp_path)
    assert len(full.bounds) == 2 * STEPS_PER_EPOCH and len(set(full.bounds)) > STEPS_PER_EPOCH  # the bound moves
    assert saved == full.bounds[STEPS_PER_EPOCH] != INITIAL_BOUND  # the bound the second epoch started at
    resumed, strategy, module = _fit(2, NOISE_FREE, ckpt_path=ckpt)
    assert resumed.bounds[0] == resumed.noised_at[0] == saved  # clipped and noised at the restored bound
    assert resumed.bounds == full.bounds[STEPS_PER_EPOCH:] and resumed.noised_at == resumed.bounds
    assert strategy.privacy_engine.current_max_grad_norm == full_strategy.privacy_engine.current_max_grad_norm
    assert strategy.privacy_engine.steps == 2 * STEPS_PER_EPOCH
    for got, want in zip(module.parameters(), full_module.parameters(), strict=True):
        assert torch.equal(got, want)


def test_a_noisy_poisson_run_resumes_at_the_saved_bound_and_keeps_moving_it(tmp_path) -> None:
    """With noise and Poisson sampling the resumed streams are fresh (no noise replayed), so only the start is
    fixed: the first step after resuming clips and noises at the checkpoint's bound, and the bound moves on."""
    _fit(1, NOISY, save_to=tmp_path)
    ckpt, saved = _first_epoch_checkpoint(tmp_path)
    assert saved != INITIAL_BOUND
    resumed, strategy, _ = _fit(2, NOISY, ckpt_path=ckpt)
    assert resumed.bounds[0] == resumed.noised_at[0] == saved
    assert len(set(resumed.bounds)) == len(resumed.bounds) == strategy.privacy_engine.steps - STEPS_PER_EPOCH
    assert strategy.privacy_engine.current_max_grad_norm != saved
    assert strategy.privacy_engine.steps == 2 * STEPS_PER_EPOCH
