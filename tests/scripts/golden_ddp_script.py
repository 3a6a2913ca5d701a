"""Run by tests/structure/test_golden.py: ``python golden_ddp_script.py OUT_FILE`` trains the digits CNN with
DPDDPStrategy on 2 CPU processes (gloo, Lightning's own launcher starts rank 1), with fixed seeds and one thread per
process; rank 0 writes epsilon, the calibrated noise, the parameter fingerprint, the intra-op thread count and the
ATen CPU capability of each rank to ``OUT_FILE`` (JSON), and each rank's trained state_dict (float32, key order) as
a list in rank order to ``OUT_FILE`` with the suffix ``.pt`` (torch.save)."""

import json
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from lightning_dp import DPDDPStrategy, PrivacyAccountantCallback
from lightning_dp.cli.args import quiet_lightning
from lightning_dp.tasks.digits import DigitsCNN, DigitsDataModule

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers

from helpers import parameter_fingerprint

if __name__ == "__main__":
    out = Path(sys.argv[1])
    os.environ["OMP_NUM_THREADS"] = "1"  # rank 1 inherits it, and Lightning then leaves the thread count alone
    torch.set_num_threads(1)  # float results depend on the intra-op thread count
    quiet_lightning()
    pl.seed_everything(0, verbose=False)
    model = DigitsCNN(lr=1.0, momentum=0.5)
    strategy = DPDDPStrategy(
        target_epsilon=3.0,
        target_delta=1e-5,
        max_grad_norm=1.0,
        clipping="ghost",
        noise="gaussian",
        seed=0,
        process_group_backend="gloo",
    )
    callback = PrivacyAccountantCallback(plot=False)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        limit_val_batches=0,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=64))  # 64 per process: q = 128 / N as in the demo
    engine = strategy.privacy_engine
    mine = {
        "epsilon": engine.epsilon(),
        "summary_epsilon": callback.summary["epsilon"] if callback.summary else None,
        "noise_multiplier": engine.mechanism.noise_multiplier,
        "steps": engine.steps,
        "sample_rate": engine.sample_rate,
        "intra_op_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "fingerprint": parameter_fingerprint(model, values=True),
    }
    ranks = [None] * trainer.world_size
    dist.all_gather_object(ranks, mine)
    if trainer.global_rank == 0:
        torch.save([rank["fingerprint"].pop("values") for rank in ranks], out.with_suffix(".pt"))
        out.write_text(json.dumps({"world_size": trainer.world_size, "ranks": ranks}, indent=1))
