"""Faults on several processes under ``accelerate launch`` (torchrun's elastic agent) + DPTrainer, 2 CPU processes
over gloo (``hf_fault_script.py``): one rank SIGKILLed mid-epoch, one rank raising inside its forward, rank 0 killed
while it saves a checkpoint folder (after the Trainer's files, before the privacy state). Each time the whole job
must end within seconds and leave the newest COMPLETE checkpoint folder holding the ledger of an uninterrupted run,
and ``resume_from_checkpoint=True`` must continue from it with that ledger at every step, the checkpoint's parameters,
and no step counted twice or lost. The raising rank leaves the same checkpoint folder as the killed one, so only the
latter is resumed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fault_helpers import STOP_WITHIN, job_end, wait_until
from hf_helpers import FAULT_MAX_STEPS, checksum
from process_helpers import SCRIPTS, free_port, launch_env

from lightning_dp.accounting import make_accountant
from lightning_dp.hf.callbacks import PRIVACY_STATE_NAME

SCRIPT = SCRIPTS / "hf_fault_script.py"


def _command(out: Path, *args: str) -> tuple[list[str], dict[str, str]]:
    env = launch_env()
    launch = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu"]
    launch += ["--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]
    launch += ["--dynamo_backend", "no", "--main_process_port", str(free_port())]
    return [*launch, str(SCRIPT), str(out), *args], env


def _launch(out: Path, *args: str) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    command, env = _command(out, *args)
    log = (out / "log.txt").open("w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=log)


def _curve(out: Path, rank: int) -> list[str]:
    path = out / f"curve{rank}.txt"
    return path.read_text().splitlines() if path.exists() else []


def _ledger_epsilon(state: dict, steps: int) -> tuple[dict, float]:
    """The ledger an uninterrupted run holds after ``steps`` steps of the checkpoint's (single) event, and its
    epsilon."""
    ((event, _),) = state["accountant"]["ledger"]
    ledger = {"name": state["accountant"]["name"], "ledger": [[event, steps]]}
    accountant = make_accountant(ledger["name"])
    accountant.load_state_dict(ledger)
    return ledger, accountant.get_epsilon(state["target_delta"])


def _check_checkpoint(out: Path, first_steps: int) -> dict:
    """The privacy state of checkpoint folder ``first_steps``: the ledger of ``first_steps`` steps at q = 1/4."""
    saved = json.loads((out / "trainer" / f"checkpoint-{first_steps}" / PRIVACY_STATE_NAME).read_text())
    ((event, count),) = saved["accountant"]["ledger"]
    assert count == first_steps and event["sample_rate"] == 0.25  # q = 4 * 2 / 32
    return saved


def _check_resume(out: Path, first_steps: int) -> None:
    """Resume from checkpoint folder ``first_steps`` (``resume_from_checkpoint=True``) and check the continued run."""
    folder = out / "trainer" / f"checkpoint-{first_steps}"
    saved = _check_checkpoint(out, first_steps)
    for rank in range(2):  # the resumed run writes its own curves
        if (out / f"curve{rank}.txt").exists():
            (out / f"curve{rank}.txt").rename(out / f"first_curve{rank}.txt")
    command, env = _command(out, "--resume")
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    import transformers

    expected_start = checksum(transformers.GPT2LMHeadModel.from_pretrained(folder))
    ends = []
    for rank in range(2):
        start = json.loads((out / f"start{rank}.json").read_text())
        assert (start["global_step"], start["steps"]) == (first_steps, first_steps)
        assert start["params"] == expected_start  # parameters at resume == the checkpoint's, on every rank
        end = json.loads((out / f"rank{rank}.json").read_text())
        assert end["global_step"] == end["steps"] == FAULT_MAX_STEPS
        assert end["state"]["accountant"] == _ledger_epsilon(saved, FAULT_MAX_STEPS)[0]
        ends.append(end["params"])
        resumed = [line.split() for line in _curve(out, rank)]
        assert [int(step) for step, _, _ in resumed] == list(range(first_steps + 1, FAULT_MAX_STEPS + 1))
        for step, ledger_steps, epsilon in resumed:
            assert int(ledger_steps) == int(step)
            assert float(epsilon) == pytest.approx(_ledger_epsilon(saved, int(step))[1], rel=1e-9)
    assert ends[0] == ends[1]


def test_sigkill_one_rank_ends_the_job_then_resume(tmp_path):
    """Rank 1 sleeps after step 3 (mid-epoch; 4 steps per epoch; last checkpoint at 2) while rank 0 waits in step
    4's all-reduce; SIGKILL rank 1: rank 0 raises at once (gloo), torchrun's agent stops the job."""
    process = _launch(tmp_path, "--wait-at", "3", "--wait-rank", "1")
    wait_until(lambda: "waiting" in _curve(tmp_path, 1), process, tmp_path, "the kill point")
    os.kill(int((tmp_path / "pid1").read_text()), signal.SIGKILL)
    seconds = job_end(process, tmp_path, time.time())
    print(f"job ended {seconds:.1f} s after SIGKILL of rank 1")
    assert seconds < STOP_WITHIN and process.returncode != 0
    assert [int(line.split()[0]) for line in _curve(tmp_path, 0)] == [1, 2, 3]
    _check_resume(tmp_path, 2)


def test_one_rank_raising_in_forward_ends_the_job(tmp_path):
    process = _launch(tmp_path, "--raise-at", "3", "--raise-rank", "1")
    wait_until(lambda: (tmp_path / "raised").exists(), process, tmp_path, "the failing step")
    seconds = job_end(process, tmp_path, float((tmp_path / "raised").read_text()))
    print(f"job ended {seconds:.1f} s after rank 1 raised")
    assert seconds < STOP_WITHIN and process.returncode != 0
    assert "RuntimeError: test failure on rank 1 at step 4" in (tmp_path / "log.txt").read_text()
    assert sorted(p.name for p in (tmp_path / "trainer").glob("checkpoint-*")) == ["checkpoint-2"]
    _check_checkpoint(tmp_path, 2)  # the checkpoint the SIGKILL test resumes from


def test_kill_while_saving_a_checkpoint_folder_resumes_from_the_previous_one(tmp_path):
    """Rank 0 stops inside the save of checkpoint-4 after the Trainer's files, before the privacy state; SIGKILL
    it: checkpoint-4 is left without privacy state and ``resume_from_checkpoint=True`` skips it for checkpoint-2."""
    process = _launch(tmp_path, "--stall-save-at", "4")
    wait_until(lambda: (tmp_path / "writing").exists(), process, tmp_path, "the checkpoint save")
    os.kill(int((tmp_path / "pid0").read_text()), signal.SIGKILL)
    seconds = job_end(process, tmp_path, time.time())
    print(f"job ended {seconds:.1f} s after SIGKILL of rank 0 mid-save")
    assert seconds < STOP_WITHIN and process.returncode != 0
    partial = tmp_path / "trainer" / "checkpoint-4"
    assert (partial / "trainer_state.json").is_file() and not (partial / PRIVACY_STATE_NAME).exists()
    _check_resume(tmp_path, 2)
