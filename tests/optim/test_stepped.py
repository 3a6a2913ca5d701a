"""``optim/stepped.py``: the parameters a DP optimizer stepped, which a checkpoint's load must write. What counts as
written (an in-place copy, as ``load_state_dict`` makes; a parameter replaced by another tensor) and what does not (a
parameter the load left, or one no DP step touched), on plain tensors and on an FSDP2-sharded model loaded from a
DCP folder (``runtime.sharding.load_sharded_model``, which the HF adapter uses; Lightning's ``ModelParallelStrategy``
loads through the same ``set_model_state_dict``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from process_helpers import free_port, launch_env

from lightning_dp.optim.stepped import mark_stepped, replaced_by_load


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))


def test_a_stepped_parameter_the_load_left_is_refused_by_name():
    model = _model()
    mark_stepped([model[0].weight, model[1].bias])
    state = {k: v for k, v in model.state_dict().items() if k != "1.bias"}
    with pytest.raises(ValueError, match=r"holds no weights for parameter\(s\) '1.bias', which keep"):
        with replaced_by_load(model):
            model.load_state_dict(state, strict=False)


def test_a_load_that_writes_or_replaces_every_stepped_parameter_passes():
    model = _model()
    mark_stepped(model.parameters())
    with replaced_by_load(model):
        model.load_state_dict(_model().state_dict())
    with replaced_by_load(model):
        model.load_state_dict(_model().state_dict(), assign=True)  # new Parameter objects


def test_parameters_no_dp_step_touched_may_stay():
    model = _model()
    mark_stepped([model[0].weight])
    with replaced_by_load(model):
        model.load_state_dict({"0.weight": torch.zeros(3, 3)}, strict=False)


_SHARDED_LOAD = """
import os, sys, tempfile, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from lightning_dp.optim.stepped import mark_stepped, replaced_by_load
from lightning_dp.runtime.sharding import load_sharded_model, save_sharded
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
mesh = init_device_mesh("cpu", (1,))
fully_shard(model[0], mesh=mesh)
fully_shard(model, mesh=mesh)
folder = tempfile.mkdtemp() + "/state"
save_sharded(folder, model, torch.optim.SGD(model.parameters(), lr=0.1))
mark_stepped(model.parameters())
with replaced_by_load(model):
    load_sharded_model(folder, model)
dist.destroy_process_group()
print("loaded")
"""


def test_a_sharded_load_from_a_dcp_folder_counts_as_writing_every_parameter():
    done = subprocess.run(
        [sys.executable, "-c", _SHARDED_LOAD, str(free_port())],
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "loaded" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
