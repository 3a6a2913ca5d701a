"""Run by tests/adapters/test_ddp_faults.py: ``python ddp_fault_script.py OUT [--resume CKPT] [--wait-at K --wait-rank
R] [--raise-at K --raise-rank R] [--slow-save-at K]`` trains TinyRegressor with DPDDPStrategy on 2 CPU processes
through Lightning's own launcher (64 examples, batch 8 per rank: q = 1/4, 4 steps per epoch) for MAX_STEPS steps,
checkpointing every 3 steps into ``OUT/ckpt`` (``last.ckpt`` rewritten in place each time).

Every rank writes its pid to ``OUT/pid{r}``, ``OUT/start{r}.pt`` at the start of training (after a resume restored
the checkpoint: parameters, global step, ledger steps), appends ``global_step ledger_steps epsilon`` to
``OUT/curve{r}.txt`` after every step and writes ``OUT/rank{r}.pt`` at the end. Faults: ``--wait-at K`` makes rank
``--wait-rank`` write ``waiting`` into its curve once K steps are done (and their checkpoint written) and sleep
until it is killed, while the other rank goes on into the next step's all-reduce; ``--raise-at K`` makes rank
``--raise-rank``'s ``training_step`` raise once K steps are done; ``--slow-save-at K`` makes rank 0 stop in the
middle of rewriting ``last.ckpt`` at step K (half the bytes written to the temporary file) and write ``OUT/writing``.
"""

import argparse
import io
import os
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_dp import DPDDPStrategy
from lightning_dp.runtime import checkpoints

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers

from helpers import TinyRegressor, make_trainer

MAX_STEPS = 8
EVERY = 3


def _append(path: Path, line: str) -> None:
    with path.open("a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


class FailingRegressor(TinyRegressor):
    def __init__(self, out: Path, raise_at: int | None, raise_rank: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.out, self.raise_at, self.raise_rank = out, raise_at, raise_rank

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == self.raise_at and self.global_rank == self.raise_rank:
            partial = self.out / "raised.partial"  # renamed whole: the test reads the time once "raised" exists
            partial.write_text(repr(time.time()))
            partial.replace(self.out / "raised")
            raise RuntimeError(f"test failure on rank {self.global_rank} at step {self.raise_at + 1}")
        return super().training_step(batch, batch_idx)


class Record(Callback):
    def __init__(self, out: Path, wait_at: int | None, wait_rank: int) -> None:
        self.out, self.wait_at, self.wait_rank = out, wait_at, wait_rank

    def on_train_start(self, trainer, pl_module):
        engine = trainer.strategy.privacy_engine
        state = {"params": {k: v.detach().clone() for k, v in pl_module.state_dict().items()}}
        state.update(global_step=trainer.global_step, steps=engine.steps)
        torch.save(state, self.out / f"start{trainer.global_rank}.pt")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # after the previous batch's checkpoint was written (ModelCheckpoint's batch-end hook runs last)
        if trainer.global_step == self.wait_at and trainer.global_rank == self.wait_rank:
            _append(self.out / f"curve{trainer.global_rank}.txt", "waiting")
            time.sleep(600)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        engine = trainer.strategy.privacy_engine
        line = f"{trainer.global_step} {engine.steps} {engine.epsilon()!r}"
        _append(self.out / f"curve{trainer.global_rank}.txt", line)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--wait-at", type=int, default=None)
    parser.add_argument("--wait-rank", type=int, default=1)
    parser.add_argument("--raise-at", type=int, default=None)
    parser.add_argument("--raise-rank", type=int, default=1)
    parser.add_argument("--slow-save-at", type=int, default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    strategy = DPDDPStrategy(noise_multiplier=1.0, max_grad_norm=0.5, target_delta=1e-5)
    checkpoint = ModelCheckpoint(dirpath=args.out / "ckpt", every_n_train_steps=EVERY, save_top_k=-1, save_last=True)
    trainer = make_trainer(
        strategy,
        devices=2,
        max_steps=MAX_STEPS,
        callbacks=[Record(args.out, args.wait_at, args.wait_rank), checkpoint],
        enable_checkpointing=True,
    )
    (args.out / f"pid{os.environ.get('LOCAL_RANK', '0')}").write_text(str(os.getpid()))
    if args.slow_save_at is not None:
        dump = checkpoints._dump

        def slow_dump(obj, f):
            if trainer.global_step != args.slow_save_at or ".last.ckpt" not in Path(f.name).name:
                return dump(obj, f)
            buffer = io.BytesIO()
            dump(obj, buffer)
            data = buffer.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            (args.out / "writing").write_text(f.name)
            time.sleep(600)

        checkpoints._dump = slow_dump
    torch.manual_seed(0)  # the same data on every rank; the parameters are broadcast from rank 0 anyway
    module = FailingRegressor(args.out, args.raise_at, args.raise_rank, batch_size=8)
    trainer.fit(module, ckpt_path=args.resume)
    engine = strategy.privacy_engine
    result = {"params": {k: v.detach().clone() for k, v in module.state_dict().items()}}
    result.update(global_step=trainer.global_step, steps=engine.steps, ledger=engine.accountant.state_dict())
    torch.save(result, args.out / f"rank{trainer.global_rank}.pt")
