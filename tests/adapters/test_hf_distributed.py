"""DPTrainer on 2 CPU processes over gloo, launched by ``accelerate launch --config_file
configs/accelerate/ddp_2_processes.yaml``.

``hf_ddp_script.py`` trains a tiny GPT-2 on each rank (ranks other than 0 start from perturbed parameters). Checked:
(a) parameters bit-identical across ranks after 3 steps and changed from rank 0's start, the model never wrapped;
(b) the ledger and epsilon equal on both ranks and equal to a single-process DPTrainer run with the same sample rate
and steps; (c) ``q = per_device_train_batch_size * gradient_accumulation_steps * world_size / N``.
"""

from __future__ import annotations

import json

import pytest
import yaml
from hf_helpers import TokenDataset, make_trainer, tiny_gpt2
from process_helpers import SCRIPTS, TWO_PROCESSES, accelerate_launch

WORLD, BATCH, ACCUM, N = 2, 4, 2, 32


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Run hf_ddp_script.py under ``accelerate launch`` and load what each rank wrote."""
    out = tmp_path_factory.mktemp("hf_ddp")
    assert yaml.safe_load(TWO_PROCESSES.read_text())["num_processes"] == WORLD  # the file users launch with
    accelerate_launch(SCRIPTS / "hf_ddp_script.py", str(out))
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
