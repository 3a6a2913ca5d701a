"""What the multi-process fault tests share: waiting for a job to reach a point, and timing its end after a fault.

Each job writes ``pid0`` and ``pid1`` (its ranks' process ids) and ``log.txt`` into its output folder.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

STOP_WITHIN = 60.0  # seconds from the fault to the end of every process (gloo's default timeout is 30 minutes)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_until(condition, process: subprocess.Popen, out: Path, what: str, timeout: float = 240) -> None:
    """Poll ``condition()`` until true; fail (killing the job) if the job ends first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            pytest.fail(f"the job ended before {what}: {(out / 'log.txt').read_text()[-3000:]}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the job did not reach {what} in time")
        time.sleep(0.1)


def job_end(process: subprocess.Popen, out: Path, since: float) -> float:
    """Seconds from ``since`` (time.time()) until the launcher and both ranks are gone; every one of them is killed,
    and the test fails, if that takes more than twice :data:`STOP_WITHIN`."""
    pids = [int((out / f"pid{r}").read_text()) for r in range(2)]
    deadline = time.monotonic() + 2 * STOP_WITHIN
    while process.poll() is None or any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            for pid in [process.pid, *pids]:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
            pytest.fail(f"the job did not end within {2 * STOP_WITHIN} s of the fault")
        time.sleep(0.05)
    return time.time() - since
