"""Run by tests/engine/test_faults.py: ``python fault_fit_script.py OUT_DIR [--kill-at K] [--resume CKPT]`` trains
TinyRegressor (64 examples, q = 1/8, 8 steps per epoch) with DPStrategy for 12 steps, checkpointing every 3 steps
(``OUT_DIR/ckpt``, ``last.ckpt`` the newest). After every step it appends ``global_step ledger_steps epsilon`` to
``OUT_DIR/curve.txt``; with ``--kill-at K`` it writes ``waiting`` there once step K is done and its checkpoint (if
any) written, and sleeps until the parent kills it; at the end it writes ``done global_step ledger_steps``."""

import argparse
import os
import sys
import time
from pathlib import Path

from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_dp import DPStrategy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers

from helpers import TinyRegressor, make_trainer

MAX_STEPS = 12


class Curve(Callback):
    def __init__(self, path: Path, kill_at: int | None) -> None:
        self.path, self.kill_at = path, kill_at

    def _write(self, line: str) -> None:
        with self.path.open("a") as f:
            f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = trainer.strategy.privacy_engine
        self._write(f"{trainer.global_step} {engine.steps} {engine.epsilon()!r}")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # runs after the previous batch's checkpoint was written (ModelCheckpoint's batch-end hook comes last)
        if trainer.global_step == self.kill_at:
            self._write("waiting")
            time.sleep(600)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    curve = Curve(args.out / "curve.txt", args.kill_at)
    checkpoint = ModelCheckpoint(dirpath=args.out / "ckpt", every_n_train_steps=3, save_top_k=-1, save_last=True)
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=1.0, target_delta=1e-5)
    trainer = make_trainer(strategy, max_steps=MAX_STEPS, callbacks=[curve, checkpoint], enable_checkpointing=True)
    trainer.fit(TinyRegressor(batch_size=8), ckpt_path=args.resume)
    curve._write(f"done {trainer.global_step} {strategy.privacy_engine.steps}")
