"""Run by tests/adapters/test_hf_faults.py under ``accelerate launch --multi_gpu --num_processes 2``:
``hf_fault_script.py OUT [--resume] [--wait-at K --wait-rank R] [--raise-at K --raise-rank R] [--stall-save-at K]``.

DPTrainer trains a tiny GPT-2 (N = 32, per-device batch 4 on 2 ranks: q = 1/4) for FAULT_MAX_STEPS steps, saving
``OUT/trainer/checkpoint-STEP`` every 2 steps. Every rank writes its pid to ``OUT/pid{r}``, the checksum of its
parameters when training starts (after a resume loaded the checkpoint) to ``OUT/start{r}.json``, appends
``global_step ledger_steps epsilon`` to ``OUT/curve{r}.txt`` after every step and writes ``OUT/rank{r}.json`` at the
end. Faults: ``--wait-at K``: rank R writes ``waiting`` into its curve after K steps and sleeps until killed (the
other rank goes on into the next step's all-reduce); ``--raise-at K``: rank R's model forward raises in step K + 1
(writing ``OUT/raised`` with the time first); ``--stall-save-at K``: rank 0 stops while saving checkpoint-K, after
the Trainer wrote its files and before the privacy state (a callback's ``on_save`` that runs before DPTrainer's),
and writes ``OUT/writing``. ``--resume`` resumes with ``resume_from_checkpoint=True`` (the newest complete folder).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from accelerate import PartialState
from transformers import TrainerCallback

from lightning_dp.optim import distributed_context

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers

from hf_helpers import FAULT_MAX_STEPS, TokenDataset, checksum, make_trainer, tiny_gpt2


def _append(path: Path, line: str) -> None:
    with path.open("a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


class Faults(TrainerCallback):
    def __init__(self, args: argparse.Namespace, rank: int, model: torch.nn.Module) -> None:
        self.args, self.rank, self.model, self.trainer = args, rank, model, None
        model.register_forward_pre_hook(self._maybe_raise)
        self.failing = False

    def _maybe_raise(self, module, inputs):
        if self.failing:
            partial = self.args.out / "raised.partial"  # renamed whole: the test reads the time once "raised" exists
            partial.write_text(repr(time.time()))
            partial.replace(self.args.out / "raised")
            raise RuntimeError(f"test failure on rank {self.rank} at step {self.args.raise_at + 1}")

    def on_train_begin(self, args, state, control, **kwargs):
        start = {"global_step": state.global_step, "steps": self.trainer.privacy_engine.steps}
        (self.args.out / f"start{self.rank}.json").write_text(json.dumps({**start, "params": checksum(self.model)}))

    def on_step_begin(self, args, state, control, **kwargs):
        self.failing = state.global_step == self.args.raise_at and self.rank == self.args.raise_rank
        if state.global_step == self.args.wait_at and self.rank == self.args.wait_rank:
            _append(self.args.out / f"curve{self.rank}.txt", "waiting")
            time.sleep(600)

    def on_step_end(self, args, state, control, **kwargs):
        engine = self.trainer.privacy_engine
        _append(self.args.out / f"curve{self.rank}.txt", f"{state.global_step} {engine.steps} {engine.epsilon()!r}")

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.args.stall_save_at and self.rank == 0:
            (self.args.out / "writing").write_text(str(state.global_step))
            time.sleep(600)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--wait-at", type=int, default=None)
    parser.add_argument("--wait-rank", type=int, default=1)
    parser.add_argument("--raise-at", type=int, default=None)
    parser.add_argument("--raise-rank", type=int, default=1)
    parser.add_argument("--stall-save-at", type=int, default=None)
    args = parser.parse_args()
    PartialState()  # initialises torch.distributed (gloo on CPU) from the launcher's environment
    context = distributed_context()
    assert context is not None, "torch.distributed was not initialised by the launcher"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"pid{context.rank}").write_text(str(os.getpid()))
    model = tiny_gpt2()
    faults = Faults(args, context.rank, model)
    overrides = dict(max_steps=FAULT_MAX_STEPS, save_strategy="steps", save_steps=2, logging_steps=100)
    trainer = make_trainer(model, args.out / "trainer", TokenDataset(n=32), args=overrides, callbacks=[faults])
    faults.trainer = trainer
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    engine = trainer.privacy_engine
    result = {"global_step": trainer.state.global_step, "steps": engine.steps, "state": engine.state_dict()}
    result["params"] = checksum(model)
    (args.out / f"rank{context.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
