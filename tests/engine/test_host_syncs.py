"""No host synchronisation in a steady-state DP step beyond what the non-private step makes (docs/design.md section
9.2, docs/performance.md).

:class:`sync_helpers.SyncRecorder` records every call that reads a tensor on the host or sizes an output from its values
(on a GPU, a sync) during a few optimizer steps after the first ones (whose one-off checks read on purpose), on both
adapters: no such call may come from ``lightning_dp/``, and the DP step makes no more of them than the same trainer's
non-private step. The deferred finite check of the clipped sum is tested here too: a non-finite sum at a step that does
not read is never released as a number, and the next read raises. A CUDA case runs the Lightning steps under
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import math
import traceback
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from helpers import TinyRegressor, make_trainer
from hf_helpers import TokenDataset, tiny_gpt2, training_args
from hf_helpers import make_trainer as make_hf_trainer
from sync_helpers import SyncRecorder, host_reads
from torch import nn
from transformers import Trainer, TrainerCallback

from lightning_dp import DPStrategy
from lightning_dp.clipping import PerSampleClipper, rows
from lightning_dp.mechanisms import make_mechanism
from lightning_dp.optim import DPOptimizer
from lightning_dp.runtime.randomness import DPRandomness

#: optimizer steps before the recorded ones (the first step's checks read on purpose).
WARM_UP = 4
STEPS = 8


class LightningWindow(pl.Callback):
    """Turns the recorder on for the training batches from :data:`WARM_UP` on (each one whole optimizer step)."""

    def __init__(self, recorder: SyncRecorder) -> None:
        self.recorder = recorder

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.recorder.active = batch_idx >= WARM_UP

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.recorder.active = False


class HFWindow(TrainerCallback):
    """Turns the recorder on for the optimizer steps from :data:`WARM_UP` on."""

    def __init__(self, recorder: SyncRecorder) -> None:
        self.recorder = recorder

    def on_step_begin(self, args, state, control, **kwargs):
        self.recorder.active = state.global_step >= WARM_UP

    def on_step_end(self, args, state, control, **kwargs):
        self.recorder.active = False


def _lightning_syncs(strategy: DPStrategy | str, **trainer_options) -> SyncRecorder:
    recorder = SyncRecorder()
    module = TinyRegressor(per_sample=isinstance(strategy, DPStrategy))
    trainer = make_trainer(strategy, max_steps=STEPS, callbacks=[LightningWindow(recorder)], **trainer_options)
    with recorder:
        trainer.fit(module)
    return recorder


def _hf_syncs(tmp_path, private: bool) -> SyncRecorder:
    recorder = SyncRecorder()
    args = dict(max_steps=STEPS, logging_steps=100)
    if private:
        trainer = make_hf_trainer(tiny_gpt2(), tmp_path, args=args, callbacks=[HFWindow(recorder)])
    else:
        trainer = Trainer(
            model=tiny_gpt2(),
            args=training_args(tmp_path, **args),
            train_dataset=TokenDataset(),
            callbacks=[HFWindow(recorder)],
        )
    with recorder:
        trainer.train()
    return recorder


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"clipping": "flat"},
        {"clipping": "ghost"},
        {"clipping_groups": "per_layer"},
        {"momentum_length": 2},
    ],
    ids=["auto", "flat", "ghost", "groups", "momentum"],
)
def test_lightning_step_makes_no_library_sync(options) -> None:
    """DPStrategy: none from lightning_dp/, and no more than Trainer's own step with the same module."""
    private = _lightning_syncs(DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0, **options))
    plain = _lightning_syncs("auto")
    assert not private.library_calls(), private.report()
    assert len(private.calls) <= len(plain.calls), private.report()


@pytest.mark.parametrize("clipping", ["ghost", "flat"])
def test_a_gpus_paths_make_no_library_sync(clipping: str, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The paths a GPU takes where the CPU gathers rows (``rows.GATHERING_DEVICES`` emptied, run on the CPU) read
    nothing on the host either, every read counted (the CPU's own gathers are exempt only while they run)."""
    monkeypatch.setattr(rows, "GATHERING_DEVICES", frozenset())
    private = _lightning_syncs(DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0, clipping=clipping))
    assert not private.library_calls(), private.report()
    hf = _hf_syncs(tmp_path, private=True)
    assert not hf.library_calls(), hf.report()


def test_the_cpus_gathers_are_exempt_only_while_they_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gather in ``rows.zero_rows_`` is counted once the GPU's paths are taken (the exemption would otherwise hide a
    read added to them)."""
    stack = [traceback.FrameSummary(str(Path(rows.__file__)), 1, "zero_rows_")]
    assert host_reads.cpu_only(stack)
    monkeypatch.setattr(rows, "GATHERING_DEVICES", frozenset())
    assert not host_reads.cpu_only(stack)


def test_lightning_accumulation_makes_no_library_sync() -> None:
    """Two micro-batches per step: the micro-batch that does not step makes none either."""
    private = _lightning_syncs(DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0), accumulate_grad_batches=2)
    assert not private.library_calls(), private.report()


def test_adaptive_clipping_reads_its_released_count_once_per_step() -> None:
    """Adaptive clipping needs the bound on the host: exactly one read per step, of the noisy count."""
    private = _lightning_syncs(
        DPStrategy(
            noise_multiplier=1.0, max_grad_norm=1.0, seed=0, target_unclipped_quantile=0.5, unclipped_num_std=4.0
        )
    )
    calls = private.library_calls()
    assert len(calls) == STEPS - WARM_UP, private.report()
    assert all(call.caller.filename.endswith("adaptive_clipping.py") for call in calls), private.report()


def test_hf_step_makes_no_library_sync(tmp_path) -> None:
    """DPTrainer: none from lightning_dp/, and no more than transformers' Trainer on the same model."""
    private = _hf_syncs(tmp_path / "dp", private=True)
    plain = _hf_syncs(tmp_path / "plain", private=False)
    assert not private.library_calls(), private.report()
    assert len(private.calls) <= len(plain.calls), private.report()


def test_dropping_a_nonfinite_example_reads_nothing() -> None:
    """A NaN example is dropped by masking on the device: no read, the others' clipped sum exactly as without it."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 2)
    x = torch.randn(5, 3)
    x_bad = x.clone()
    x_bad[2] = math.nan
    clipper = PerSampleClipper(layer, clipping="flat", max_grad_norm=1.0, sum_check_every=None)
    recorder = SyncRecorder(active=True)
    with recorder:
        clipper.backward(layer(x_bad).square().sum(1))
    assert not recorder.library_calls(), recorder.report()
    dropped = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    keep = torch.tensor([True, True, False, True, True])
    clipper.backward(layer(x[keep]).square().sum(1))
    assert clipper.dropped_nonfinite
    assert all(torch.allclose(a, p.grad) for a, p in zip(dropped, layer.parameters(), strict=True))


def _optimizer(layer: nn.Module, every: int) -> DPOptimizer:
    return DPOptimizer(
        torch.optim.SGD(layer.parameters(), lr=0.1),
        mechanism=make_mechanism("gaussian", max_grad_norm=1.0, noise_multiplier=1.0),
        expected_batch_size=4.0,
        randomness=DPRandomness(0),
        finite_check_every=every,
    )


def _step(layer: nn.Linear, optimizer: DPOptimizer, bias_grad: float) -> None:
    layer.weight.grad = torch.zeros(2, 3)
    layer.bias.grad = torch.tensor([0.0, bias_grad])
    optimizer.step()


def test_deferred_finite_check_releases_no_number_and_raises_at_the_next_read() -> None:
    """Steps 2..4 do not read: a non-finite sum at step 3 divides every gradient by NaN (no parameter keeps a
    number that step 3's sums moved), and step 5 (the 5th: every 5th reads) raises before its noise, naming the
    parameter and the steps; a later read raises again."""
    layer = nn.Linear(3, 2)
    optimizer = _optimizer(layer, every=5)
    recorder = SyncRecorder()
    _step(layer, optimizer, 0.0)  # step 1 reads
    with recorder:
        recorder.active = True
        _step(layer, optimizer, 0.0)
        _step(layer, optimizer, math.inf)  # step 3: deferred
        assert all(torch.isnan(p).all() for p in layer.parameters())
        _step(layer, optimizer, 0.0)
        recorder.active = False
    assert not recorder.library_calls(), recorder.report()
    with pytest.raises(FloatingPointError, match=r"#1 \(2,\).*optimizer steps 2-4.*every gradient to NaN"):
        _step(layer, optimizer, 0.0)
    with pytest.raises(FloatingPointError, match="optimizer steps 2-4"):
        optimizer.check_finite()


def test_finite_check_reads_at_first_and_periodic_steps() -> None:
    """The first step and every ``finite_check_every``-th read at once: a non-finite sum there raises before the noise,
    nothing stepped; a clean read clears the deferred flags (check_finite reads nothing then)."""
    layer = nn.Linear(3, 2)
    optimizer = _optimizer(layer, every=3)
    with pytest.raises(FloatingPointError, match=r"#1 \(2,\).*not finite before the noise is added"):
        _step(layer, optimizer, math.inf)
    assert torch.equal(layer.weight.grad, torch.zeros(2, 3))
    _step(layer, optimizer, 0.0)  # step 1
    _step(layer, optimizer, 0.0)  # step 2: deferred
    weight = layer.weight.detach().clone()
    with pytest.raises(FloatingPointError, match="not finite before the noise is added"):
        _step(layer, optimizer, math.inf)  # step 3 reads
    assert torch.equal(layer.weight.detach(), weight)  # no step taken
    _step(layer, optimizer, 0.0)  # step 3 again: reads, clean
    recorder = SyncRecorder(active=True)
    with recorder:
        optimizer.check_finite()
    assert not recorder.calls


def test_engine_checks_before_a_checkpoint_and_at_the_end() -> None:
    """PrivacyEngine.state_dict (every checkpoint) and finish_run read the deferred flags of the run's optimizers."""
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    make_trainer(strategy, max_steps=3).fit(TinyRegressor())
    engine = strategy.privacy_engine
    (optimizer,) = engine._optimizers
    optimizer._pending = torch.tensor([False, True, False, False])
    with pytest.raises(FloatingPointError, match="#1"):
        engine.state_dict()
    with pytest.raises(FloatingPointError, match="#1"):
        engine.finish_run()


def test_hf_reads_the_deferred_check_before_saving_the_model(tmp_path) -> None:
    """DPTrainer: a deferred failure raises in save_model before any model file is written."""
    trainer = make_hf_trainer(tiny_gpt2(), tmp_path / "run", args=dict(max_steps=2))
    trainer.train()
    optimizer = trainer._dp_optimizer
    optimizer._pending = torch.zeros(len(optimizer.params), dtype=torch.bool)
    optimizer._pending[0] = True
    with pytest.raises(FloatingPointError, match="#0"):
        trainer.save_model(str(tmp_path / "saved"))
    assert not (tmp_path / "saved").exists() or not any((tmp_path / "saved").iterdir())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_steady_state_step_under_sync_debug_mode_error() -> None:
    """DPStrategy on CUDA: the steady-state steps run with ``set_sync_debug_mode("error")`` (any synchronising CUDA
    call raises), after the non-private step of the same module was seen to run so."""

    class ErrorWindow(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            torch.cuda.set_sync_debug_mode("error" if batch_idx >= WARM_UP else "default")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            torch.cuda.set_sync_debug_mode("default")

    try:
        for strategy in ("auto", DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)):
            module = TinyRegressor(per_sample=not isinstance(strategy, str))
            make_trainer(strategy, accelerator="gpu", devices=1, max_steps=STEPS, callbacks=[ErrorWindow()]).fit(module)
    finally:
        torch.cuda.set_sync_debug_mode("default")
