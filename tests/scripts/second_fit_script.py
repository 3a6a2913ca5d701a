"""Run by tests/engine/test_second_fit_ddp.py: ``python second_fit_script.py OUT_DIR`` trains ``ZeroGradModule`` (every
update is pure noise) with ``DPDDPStrategy`` (seed 0) on 2 CPU processes through Lightning's own launcher, twice in
the same processes: once for 6 steps in one ``fit``, then with a fresh strategy and trainer for 3 steps, and the
same trainer again up to step 6 (a second ``fit``). Every rank writes each run's per-step parameter updates and
batches (dataset indices) to ``OUT_DIR/rank{r}.pt``."""

import argparse
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_dp import DPDDPStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers

from helpers import BatchIndexRecorder, ZeroGradModule, make_trainer


class UpdateRecorder(pl.Callback):
    """Records each optimizer step's parameter update (``[k, d]``, the weight after the step minus before)."""

    def __init__(self) -> None:
        self.updates: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._before = pl_module.layer.weight.detach().clone()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.updates.append(pl_module.layer.weight.detach() - self._before)


def run(max_steps: list[int]) -> dict:
    """Fit a fresh module (the same data on every rank) with a fresh strategy, once per entry of ``max_steps`` (the
    same trainer, ``max_steps`` raised before each further ``fit``)."""
    torch.manual_seed(0)
    module = ZeroGradModule(d=40, k=5, n=64, batch_size=4)
    strategy = DPDDPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    updates, batches = UpdateRecorder(), BatchIndexRecorder(module.data.tensors[0])
    trainer = make_trainer(strategy, devices=2, max_steps=max_steps[0], callbacks=[updates, batches])
    for steps in max_steps:
        trainer.fit_loop.epoch_loop.max_steps = steps
        trainer.fit(module)
    return {
        "updates": updates.updates,
        "batches": batches.batches,
        "steps": strategy.privacy_engine.steps,
        "epsilon": strategy.privacy_engine.epsilon(),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    out = parser.parse_args().out
    whole, twice = run([6]), run([3, 6])
    rank = torch.distributed.get_rank()
    torch.save({"rank": rank, "whole": whole, "twice": twice}, out / f"rank{rank}.pt")
