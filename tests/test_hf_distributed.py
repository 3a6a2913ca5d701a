"""DPTrainer on 2 CPU processes over gloo, launched by ``accelerate launch --config_file
configs/accelerate/ddp_2_processes.yaml``.

``hf_ddp_script.py`` trains a tiny GPT-2 on each rank (ranks other than 0 start from perturbed parameters). Checked:
(a) parameters bit-identical across ranks after 3 steps and changed from rank 0's start, the model never wrapped;
(b) the ledger and epsilon equal on both ranks and equal to a single-process DPTrainer run with the same sample rate
and steps; (c) ``q = per_device_train_batch_size * gradient_accumulation_steps * world_size / N``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hf_helpers import TokenDataset, make_trainer, tiny_gpt2

WORLD, BATCH, ACCUM, N = 2, 4, 2, 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Run hf_ddp_script.py under ``accelerate launch`` and load what each rank wrote."""
    out = tmp_path_factory.mktemp("hf_ddp")
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    for name in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(name, None)
    config = root / "configs" / "accelerate" / "ddp_2_processes.yaml"  # the file users launch with
    assert yaml.safe_load(config.read_text())["num_processes"] == WORLD
    launch = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(config)]
    launch += ["--main_process_port", str(_free_port())]
    script = [str(Path(__file__).with_name("hf_ddp_script.py")), str(out)]
    done = subprocess.run([*launch, *script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def test_accelerate_launch_trains_identical_ranks_with_the_single_process_epsilon(ranks, tmp_path) -> None:
    a, b = ranks
    assert (a["rank"], b["rank"], a["world_size"], b["world_size"]) == (0, 1, WORLD, WORLD)
    # (a) one noise draw for all ranks on the same reduced sum: bit-identical parameters, moved from rank 0's start
    assert a["end"] == b["end"] != a["start"]
    assert a["model_unwrapped"] and b["model_unwrapped"]  # never DistributedDataParallel
    assert a["steps"] == b["steps"] == 3
    # (c) the global sample rate over the ranks' shards
    assert a["sample_rate"] == b["sample_rate"] == BATCH * ACCUM * WORLD / N
    # (b) the same ledger and epsilon on every rank, and the single-process epsilon for that q and number of steps
    assert a["state"] == b["state"]
    assert a["epsilon"] == b["epsilon"]
    single = make_trainer(
        tiny_gpt2(),
        tmp_path,
        TokenDataset(n=N),
        args=dict(per_device_train_batch_size=BATCH * WORLD, gradient_accumulation_steps=ACCUM, max_steps=3),
    )
    single.train()
    engine = single.privacy_engine
    assert engine.sample_rate == a["sample_rate"]
    assert engine.state_dict() == a["state"]
    assert engine.epsilon() == pytest.approx(a["epsilon"], rel=1e-12)
