"""The test tree mirrors the package (``tests/clipping/`` for ``lightning_dp/clipping``, ...); the shared helpers stay
in this folder (``helpers``, ``clipping_helpers``, ``hf_helpers``, ``process_helpers``, ...) and the scripts the tests
launch in subprocesses are in ``scripts/``. Every test imports the helpers by their plain names (``from helpers import
TinyRegressor``), so this folder is put on ``sys.path`` here, whichever subfolder the test is in; a test file is never
imported from another one.

The suite runs on ``pytest-xdist`` workers (``-n auto`` in pyproject's ``addopts``), as many as
:func:`pytest_xdist_auto_num_workers` says; ``-n 0`` runs in this process (for ``--pdb``, or one test)."""

import os
import sys
from pathlib import Path

import pytest

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)


#: Memory to allow per worker (a worker's peak, with the 2-process tests it launches, stays below this).
GIB_PER_WORKER = 6
#: The most workers ``-n auto`` starts, whatever the machine.
MAX_WORKERS = 4


def _cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _memory_gib() -> float:
    """The memory this process may use: the cgroup's limit where one is set (a container), else the machine's; ``inf``
    where neither can be read."""
    limit = Path("/sys/fs/cgroup/memory.max")
    if limit.is_file() and limit.read_text().strip().isdigit():
        return int(limit.read_text()) / 2**30
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return float("inf")


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto``: one worker per CPU, at most :data:`MAX_WORKERS` and one per :data:`GIB_PER_WORKER` GiB of memory;
    ``PYTEST_XDIST_AUTO_NUM_WORKERS`` (read by xdist itself) overrides it."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    cpus = _cpus()
    by_memory = _memory_gib() // GIB_PER_WORKER
    return int(max(1, min(cpus, MAX_WORKERS, by_memory)))


def pytest_configure(config: pytest.Config) -> None:
    """On one of several xdist workers, torch's intra-op threads (and, through ``OMP_NUM_THREADS``, those of the
    processes the worker launches) are the worker's share of the CPUs: torch's default, one thread per core in every
    worker, has the workers' threads wait on each other's cores. An ``OMP_NUM_THREADS`` of the caller's is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    threads = max(1, _cpus() // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
