"""``engine/weight_loads.py``: a load with the checkpoint's privacy state must write every trainable weight. What
counts as written (an in-place copy, as ``load_state_dict`` makes; a parameter replaced by another tensor) and what
does not (a trainable parameter the load left, or gave other data through ``.data``); a checkpoint's keys checked
before a load that would write a missing weight with its own value; on plain tensors and on an FSDP2-sharded model
loaded from a DCP folder (``runtime.sharding.load_sharded_model``, the HF adapter's sharded load), whose parameters
can still be moved after it (``Module._apply`` swaps DTensor parameters, which a reference kept past the load would
forbid)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from process_helpers import free_port, launch_env

from lightning_dp.engine.weight_loads import check_checkpoint_keys, trainable_weights_written


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))


def test_a_trainable_parameter_the_load_left_is_refused_by_name():
    model = _model()
    state = {k: v for k, v in _model().state_dict().items() if k != "1.bias"}
    with pytest.raises(ValueError, match=r"did not write trainable parameter\(s\) '1.bias', so they would keep"):
        with trainable_weights_written(model):
            model.load_state_dict(state, strict=False)


def test_a_load_that_copies_into_or_replaces_every_trainable_parameter_passes():
    model = _model()
    with trainable_weights_written(model):
        model.load_state_dict(_model().state_dict())
    with trainable_weights_written(model):
        model.load_state_dict(_model().state_dict(), assign=True)  # new Parameter objects
    with pytest.raises(ValueError, match="did not write"), trainable_weights_written(model):
        for p in model.parameters():
            p.data = torch.zeros_like(p)  # not seen: ``.data`` keeps the version counter (a cast is written so too)


def test_a_checkpoint_whose_keys_lack_a_trainable_parameter_is_refused():
    model = _model()
    check_checkpoint_keys(model, model.state_dict().keys())
    with pytest.raises(ValueError, match=r"did not write trainable parameter\(s\) '0.bias'"):
        check_checkpoint_keys(model, ["0.weight", "1.weight", "1.bias"])
    model[0].bias.requires_grad_(False)
    check_checkpoint_keys(model, ["0.weight", "1.weight", "1.bias"])


def test_frozen_parameters_may_stay():
    model = _model()
    model[1].requires_grad_(False)
    with trainable_weights_written(model):
        model.load_state_dict({k: v for k, v in _model().state_dict().items() if k.startswith("0.")}, strict=False)


_SHARDED_LOAD = """
import os, sys, tempfile, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from lightning_dp.engine.weight_loads import trainable_weights_written
from lightning_dp.runtime.sharding import load_sharded_model, save_sharded
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
mesh = init_device_mesh("cpu", (1,))
fully_shard(model[0], mesh=mesh)
fully_shard(model, mesh=mesh)
folder = tempfile.mkdtemp() + "/state"
save_sharded(folder, model, torch.optim.SGD(model.parameters(), lr=0.1))
with trainable_weights_written(model):
    load_sharded_model(folder, model)
model.to(torch.float64)  # swaps the DTensor parameters: no reference to them may remain
dist.destroy_process_group()
print("loaded")
"""


def test_a_sharded_load_from_a_dcp_folder_writes_every_parameter():
    done = subprocess.run(
        [sys.executable, "-c", _SHARDED_LOAD, str(free_port())],
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and "loaded" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
