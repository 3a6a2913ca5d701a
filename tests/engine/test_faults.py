"""Faults and resumes: a real training process killed with SIGKILL mid-epoch and resumed from its
last checkpoint; resumes under another configuration; truncated, corrupted and stripped checkpoints."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import TinyRegressor, make_trainer
from process_helpers import SCRIPTS

from lightning_dp import DPStrategy
from lightning_dp.accounting import make_accountant
from lightning_dp.mechanisms import make_mechanism

SCRIPT = SCRIPTS / "fault_fit_script.py"
KILL_AT = 7  # mid-epoch (8 steps per epoch); the last checkpoint is at step 6


def _env() -> dict[str, str]:
    root = Path(__file__).resolve().parents[2]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}


def _start(out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), str(out), *args], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def _curve(out: Path) -> list[str]:
    path = out / "curve.txt"
    return path.read_text().splitlines() if path.exists() else []


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory) -> Path:
    """A training process SIGKILLed while waiting in step KILL_AT + 1 (mid-epoch)."""
    out = tmp_path_factory.mktemp("killed")
    process = _start(out, "--kill-at", str(KILL_AT))
    deadline = time.monotonic() + 240
    while "waiting" not in _curve(out):
        if process.poll() is not None:
            pytest.fail(f"the training process ended before the kill: {process.stdout.read().decode()[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("the training process did not reach the kill point in time")
        time.sleep(0.2)
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait(timeout=60) == -signal.SIGKILL
    return out


def _expected_epsilon(steps: int) -> float:
    """Epsilon of ``steps`` steps of this run's event, from a fresh accountant."""
    mechanism = make_mechanism("gaussian", noise_multiplier=1.0, max_grad_norm=1.0)
    accountant = make_accountant("pld")
    accountant.compose(mechanism.step_event(1 / 8, 1), steps)
    return accountant.get_epsilon(1e-5)


def test_sigkill_mid_epoch_then_resume_keeps_the_epsilon_curve(killed_run):
    first = [line.split() for line in _curve(killed_run) if line != "waiting"]
    assert [int(step) for step, _, _ in first] == list(range(1, KILL_AT + 1))
    last = killed_run / "ckpt" / "last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == 6  # step 7 was lost with the process
    resumed_out = killed_run / "resumed"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(resumed_out), "--resume", str(last)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = _curve(resumed_out)
    assert lines[-1] == "done 12 12"  # the ledger counts exactly the steps of the resumed trajectory: 6 + 6
    resumed = [line.split() for line in lines[:-1]]
    assert [int(step) for step, _, _ in resumed] == list(range(7, 13))
    trajectory = [row for row in first if int(row[0]) <= 6] + resumed
    for step, ledger_steps, epsilon in trajectory:
        assert int(ledger_steps) == int(step)
        assert float(epsilon) == pytest.approx(_expected_epsilon(int(step)), rel=1e-9)
    epsilons = [float(e) for _, _, e in trajectory]
    assert all(b > a for a, b in zip(epsilons, epsilons[1:], strict=False))  # strictly increasing, no reset


@pytest.mark.parametrize(
    ("kwargs", "module_kwargs", "message"),
    [
        ({"noise_multiplier": 1.0, "max_grad_norm": 2.0}, {}, "max_grad_norm"),
        ({"noise_multiplier": 1.5}, {}, "noise"),
        ({"noise": "lap2", "noise_params": {"noise_scale": 2.0}}, {}, "noise='gaussian'"),
        ({"noise_multiplier": 1.0}, {"batch_size": 16}, "sample_rate"),
    ],
)
def test_resume_under_another_configuration_is_refused(killed_run, kwargs, module_kwargs, message):
    strategy = DPStrategy(target_delta=1e-5, **kwargs)
    trainer = make_trainer(strategy, max_steps=20)
    with pytest.raises(ValueError, match=message):
        trainer.fit(TinyRegressor(**module_kwargs), ckpt_path=killed_run / "ckpt" / "last.ckpt")


def _resume(path: Path) -> DPStrategy:
    strategy = DPStrategy(noise_multiplier=1.0, target_delta=1e-5)
    make_trainer(strategy, max_steps=20).fit(TinyRegressor(batch_size=8), ckpt_path=path)
    return strategy


@pytest.mark.parametrize("keep", [0.5, 0.9, 0.0])
def test_truncated_checkpoint_fails_clearly(killed_run, tmp_path, keep):
    data = (killed_run / "ckpt" / "last.ckpt").read_bytes()
    path = tmp_path / "truncated.ckpt"
    path.write_bytes(data[: math.floor(len(data) * keep)])
    with pytest.raises(ValueError, match="truncated or corrupted.*never reset"):
        _resume(path)


def test_corrupted_checkpoint_fails_clearly(killed_run, tmp_path):
    data = bytearray((killed_run / "ckpt" / "last.ckpt").read_bytes())
    for i in range(0, len(data), 97):
        data[i] ^= 0xFF
    path = tmp_path / "corrupted.ckpt"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="truncated or corrupted"):
        _resume(path)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.pop("lightning_dp"), "no privacy state.*restart epsilon at 0"),
        (lambda c: c["lightning_dp"]["accountant"].update(ledger=[]), "ledger is empty"),
        (lambda c: c["lightning_dp"].pop("accountant"), "corrupted or incomplete.*missing entries"),
        (lambda c: c["lightning_dp"]["accountant"].pop("name"), "corrupted or incomplete.*no accountant name"),
        (lambda c: c["lightning_dp"]["accountant"].update(ledger=[[{"type": "nonsense"}, 6]]), "ledger cannot be read"),
        (lambda c: c["lightning_dp"]["accountant"]["ledger"][0].__setitem__(1, -6), "positive count"),
        (lambda c: c["lightning_dp"].update(sample_rate=0.0), "sample_rate=0.0"),
    ],
)
def test_damaged_privacy_state_never_resets_the_ledger(killed_run, tmp_path, edit, message):
    checkpoint = torch.load(killed_run / "ckpt" / "last.ckpt", weights_only=False)
    edit(checkpoint)
    path = tmp_path / "damaged.ckpt"
    torch.save(checkpoint, path)
    with pytest.raises(ValueError, match=message):
        _resume(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"accountant": {"name": "pld", "ledger": [[{"type"', "truncated or corrupted.*never reset"),
        ("\x00\x01garbage", "truncated or corrupted"),
        ('{"accountant": {"name": "pld", "ledger": []}}', "corrupted or incomplete.*missing entries"),
    ],
)
def test_hf_damaged_privacy_state_fails_clearly(tmp_path, text, message):
    from lightning_dp.engine.privacy_engine import PrivacyEngine
    from lightning_dp.hf.callbacks import PRIVACY_STATE_NAME, load_privacy_state

    (tmp_path / PRIVACY_STATE_NAME).write_text(text)
    engine = PrivacyEngine(max_grad_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match=message):
        load_privacy_state(engine, tmp_path)
    assert engine.accountant is None  # nothing restored, nothing reset
