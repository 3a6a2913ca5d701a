"""Helpers of the tests that start processes: the repository's file list, a 2-process ``accelerate launch``, and a
2-process Lightning run of ``ddp_fit_script.py``."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: the scripts the tests launch in subprocesses (each puts ``tests/`` on ``sys.path`` for the shared helpers).
SCRIPTS = Path(__file__).resolve().parent / "scripts"
#: the accelerate config file users launch 2 processes with (gloo on a machine without GPUs).
TWO_PROCESSES = ROOT / "configs" / "accelerate" / "ddp_2_processes.yaml"


def repository_files() -> list[str]:
    """The repository's files as git lists them (tracked, and untracked but not ignored), relative to its root;
    ``[]`` without git."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return []
    return [name for name in listed if (ROOT / name).is_file()]


#: The variables of a process group, which a launch must not inherit (an in-process Lightning DDP fit leaves them in
#: ``os.environ``; a launch that sees ``LOCAL_RANK`` starts one rank and waits for the other).
PROCESS_GROUP_VARIABLES = ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK")


def launch_env() -> dict[str, str]:
    """``os.environ`` for a launched subprocess: this checkout first on ``PYTHONPATH``, no process-group variables, and
    ``PYTHONFAULTHANDLER=1``, so that a process that crashes (a segfault in a collective) prints its Python stack into
    the output a failing test shows."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.setdefault("PYTHONFAULTHANDLER", "1")
    for name in PROCESS_GROUP_VARIABLES:
        env.pop(name, None)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def accelerate_launch(
    script: Path | str,
    *args: str,
    config: Path | str = TWO_PROCESSES,
    timeout: float = 600,
    cwd: Path | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run ``accelerate launch --config_file CONFIG SCRIPT ARGS`` (from ``cwd``, so that relative paths read as a
    user's command does) with this checkout first on ``PYTHONPATH``, on a free port and without inherited
    process-group variables; with ``check``, a failing launch fails the test with the processes' output. Returns the
    finished launch, its stdout and stderr combined in ``stdout``."""
    env = launch_env()
    launch = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(config)]
    launch += ["--main_process_port", str(free_port()), str(script), *args]
    done = subprocess.run(
        launch, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout
    )
    assert done.returncode == 0 or not check, done.stdout[-6000:]
    return done


def fit_on_two_processes(out: Path, *args: str, script: str = "ddp_fit_script.py") -> list[dict]:
    """Run ``SCRIPT OUT ARGS`` from tests/scripts (Lightning launches the second rank; this checkout first on
    ``PYTHONPATH``) and load what each rank wrote."""
    import torch

    done = subprocess.run(
        [sys.executable, str(SCRIPTS / script), str(out), *args],
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
