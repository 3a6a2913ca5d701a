"""What a run prints when it starts: the start-up block of the engine (once, with the engine's own numbers) on the HF
and the Lightning paths, in a plain script that set up no logging; the warning when accelerate started fewer
processes than asked for; the progress lines of ``TrainingProgress``."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from process_helpers import SCRIPTS

from lightning_dp.engine.startup import HEADER
from lightning_dp.runtime.console import show_info_lines
from lightning_dp.runtime.launch_check import TWO_PROCESSES_CONFIG, process_count_warning

ROOT = Path(__file__).resolve().parents[2]
#: What accelerate's simple launcher sets in its one child for ``accelerate launch --num_processes 2`` (no
#: ``--multi_gpu``): no WORLD_SIZE, the rendezvous address of the processes it does not start.
SIMPLE_LAUNCHER_TWO = {"ACCELERATE_USE_CPU": "False", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
LAUNCH_VARIABLES = ("ACCELERATE_USE_CPU", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK")


def run_script(path: str, extra_env: dict[str, str]) -> tuple[dict, str]:
    """Run ``tests/scripts/startup_script.py PATH`` (this checkout first on ``PYTHONPATH``, no launcher variables but
    ``extra_env``); return the engine's numbers it prints last and everything else it wrote (stdout and stderr)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env.update(extra_env, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "startup_script.py"), path],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    *_, facts = done.stdout.strip().splitlines()
    return json.loads(facts), done.stdout + done.stderr


def startup_rows(output: str) -> dict[str, str]:
    """The rows of the one start-up block in ``output``, ``label -> value`` (the continuation lines of a row are
    left out)."""
    assert output.count(HEADER) == 1, output
    lines = output.split(HEADER, 1)[1].splitlines()[1:]
    rows = {}
    for line in lines:
        match = re.match(r"^  (\S.*?) {2,}(\S.*)$", line)
        if match is None:
            if not line.startswith(" " * 4):
                break
            continue
        rows[match[1]] = match[2]
    return rows


def check_rows(rows: dict[str, str], facts: dict, *, batch: int, micro_batches: int) -> None:
    """The block's numbers are the engine's: q, N, the planned steps, sigma, delta, and q N = batch x micro-batches
    on one process."""
    assert rows["world size"] == "1 process(es)"
    assert rows["per-device batch"].startswith(f"{batch} (expected size: Poisson sampling)")
    assert rows["gradient accumulation"].startswith(f"{micro_batches} micro-batch")
    assert float(rows["global expected batch"].removeprefix("q N = ")) == pytest.approx(batch * micro_batches)
    assert float(rows["q (sample rate)"]) == pytest.approx(facts["q"], rel=1e-5)
    assert int(rows["N (training examples)"]) == facts["N"]
    assert int(rows["planned steps"]) == facts["planned_steps"]
    sigma = float(re.search(r"noise_multiplier=([0-9.e+-]+)", rows["noise"])[1])
    assert sigma == pytest.approx(facts["noise_multiplier"], rel=1e-3)
    assert "calibrated for epsilon=3 over" in rows["noise"]
    assert float(rows["delta"]) == pytest.approx(facts["delta"], rel=1e-2)
    assert rows["accountant"] == facts["accountant"]
    assert rows["clipping"] == "mixed"  # clipping="auto", resolved for Gaussian noise
    assert rows["defaults applied"].startswith(f"sample_rate = batch_size {batch} x accumulation {micro_batches}")


def test_dptrainer_prints_the_block_once_and_warns_about_the_missing_process() -> None:
    facts, output = run_script("hf", SIMPLE_LAUNCHER_TWO)
    check_rows(startup_rows(output), facts, batch=4, micro_batches=2)
    assert "target_delta = 1/N^1.1" in output and "accountant = 'pld'" in output  # the other defaults
    assert "clipping = 'mixed' with book-keeping (auto: the fastest exact engine for an l2 mechanism)" in output
    warnings = [line for line in output.splitlines() if line.startswith("warning: accelerate launch")]
    assert len(warnings) == 1 and f"--config_file {TWO_PROCESSES_CONFIG}" in warnings[0]
    assert "'epsilon'" in output  # the Trainer's log lines carry epsilon


def test_lightning_prints_the_block_once_and_progress_lines() -> None:
    facts, output = run_script("lightning", {})
    check_rows(startup_rows(output), facts, batch=8, micro_batches=2)
    assert "warning: accelerate launch" not in output
    steps = re.findall(r"^step (\d+)/4: loss [0-9.]+, epsilon [0-9.]+ \(\d+ s\)$", output, flags=re.MULTILINE)
    assert steps == ["2", "4"], output


@pytest.mark.parametrize(
    ("world_size", "environ", "expected"),
    [
        (1, SIMPLE_LAUNCHER_TWO, "accelerate launch was asked for several processes"),
        (1, {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "WORLD_SIZE=2"),
        (2, {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "ACCELERATE_USE_CPU": "False"}, None),
        (1, {"ACCELERATE_USE_CPU": "False"}, None),  # accelerate launch of one process
        (1, {"MASTER_ADDR": "10.0.0.1"}, None),  # a rendezvous address alone: no launcher asked for more
        (1, {}, None),
    ],
)
def test_process_count_warning(world_size: int, environ: dict[str, str], expected: str | None) -> None:
    warning = process_count_warning(world_size, environ, ["recipes/glue.py", "--config", "configs/glue_offline.yaml"])
    if expected is None:
        assert warning is None
    else:
        assert expected in warning
    if expected and "accelerate launch" in expected:
        command = f"accelerate launch --config_file {TWO_PROCESSES_CONFIG} recipes/glue.py --config configs/glue"
        assert command in warning


def test_outside_the_repository_the_process_count_warning_gives_the_flags(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # a pip-installed user's folder: no configs/accelerate there
    warning = process_count_warning(1, SIMPLE_LAUNCHER_TWO, ["train.py", "--lr", "0.1"])
    assert "run: accelerate launch --multi_gpu --num_processes 2 train.py --lr 0.1 (" in warning


def test_console_handler_only_while_no_logging_is_set_up(monkeypatch, capsys) -> None:
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    logger = logging.getLogger("startup_console_test")
    monkeypatch.setattr(logger, "handlers", [])
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    show_info_lines(logger)
    show_info_lines(logger)  # the second call adds nothing
    assert len(logger.handlers) == 1 and logger.level == logging.INFO
    logger.info("shown")
    records: list[logging.LogRecord] = []
    collector = logging.Handler()
    collector.emit = records.append
    monkeypatch.setattr(root, "handlers", [collector])  # e.g. a later logging.basicConfig(level=logging.WARNING)
    monkeypatch.setattr(root, "level", logging.WARNING)
    logger.info("hidden by the user's level")
    logger.warning("left to the root's handler")
    assert capsys.readouterr().err == "shown\n"
    assert [r.getMessage() for r in records] == ["left to the root's handler"]
    assert logger.handlers == [] and logger.filters == [] and logger.level == logging.NOTSET  # handed back
