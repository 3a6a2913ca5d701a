"""A DPTrainer run reporting to TensorBoard, MLflow and W&B (offline), for tests/adapters/test_trackers.py.

Usage: ``python hf_trackers_script.py OUT_DIR TRACKER...``. Runs in its own process because the trackers keep
process-wide state (W&B's settings, MLflow's active run) that an earlier run in the same process would leak into
this one. The stores go under ``OUT_DIR`` (``tb``, ``mlruns``, ``wandb``); ``OUT_DIR/run.json`` holds the Trainer's
``log_history`` and the privacy summary.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared helpers

from hf_helpers import TokenDataset, make_trainer, tiny_gpt2


def main(out: Path, report_to: list[str]) -> None:
    os.environ.update(
        MLFLOW_TRACKING_URI=(out / "mlruns").as_uri(),
        MLFLOW_EXPERIMENT_NAME="dp",
        MLFLOW_ALLOW_FILE_STORE="true",  # MLflow keeps its local file store in maintenance: opted into
        WANDB_MODE="offline",
        WANDB_DIR=str(out),
        WANDB_SILENT="true",
        TENSORBOARD_LOGGING_DIR=str(out / "tb"),
    )
    trainer = make_trainer(tiny_gpt2(), out / "trainer", TokenDataset(), args=dict(max_steps=4, report_to=report_to))
    trainer.train()
    if "wandb" in report_to:
        import wandb

        wandb.finish()
    summary = trainer.privacy_engine.summary()
    (out / "run.json").write_text(json.dumps({"log_history": trainer.state.log_history, "summary": summary}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
