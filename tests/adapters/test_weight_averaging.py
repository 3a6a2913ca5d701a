"""Parameter averaging (EMA of the weights, De et al. 2022) with DP training: Lightning's own
``EMAWeightAveraging`` callback works with ``DPStrategy`` unchanged. The average is post-processing of the released
iterates (no privacy cost, the accountant unchanged); at the end of training the model holds the averaged weights.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from helpers import TinyRegressor, make_trainer
from lightning.pytorch.callbacks import EMAWeightAveraging

from lightning_dp import DPStrategy


class IterateRecorder(pl.Callback):
    """The parameters after every training step (listed before the averaging callback, so it sees the iterate)."""

    def __init__(self) -> None:
        self.iterates: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.iterates.append({n: p.detach().clone() for n, p in pl_module.named_parameters()})


def test_lightnings_ema_callback_averages_the_dp_iterates() -> None:
    recorder, decay = IterateRecorder(), 0.6
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    model = TinyRegressor()
    trainer = make_trainer(strategy, max_steps=6, callbacks=[recorder, EMAWeightAveraging(decay=decay)])
    trainer.fit(model)
    assert len(recorder.iterates) == strategy.privacy_engine.steps == 6
    average = recorder.iterates[0]  # the average starts as a copy of the first iterate
    for iterate in recorder.iterates[1:]:
        average = {name: decay * average[name] + (1 - decay) * value for name, value in iterate.items()}
    for name, value in model.named_parameters():
        torch.testing.assert_close(value.detach(), average[name], rtol=0, atol=1e-6, msg=name)
        assert not torch.equal(value.detach(), recorder.iterates[-1][name])  # the average, not the last iterate
