"""Progress output that suits where it goes: in a terminal, Lightning's bar with epsilon to four decimals (as the epoch
table shows it); in a log file, no bar, and one line per epoch or per ``log_every_n_steps`` steps
(``lightning-dp demo``'s redirected output is tested in test_cli_ux.py)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from jsonargparse import Namespace
from lightning.pytorch.callbacks import TQDMProgressBar

from lightning_dp.cli.fit import choose_progress_display
from lightning_dp.lightning.progress_bar import (
    EpsilonTQDMProgressBar,
    epsilon_progress_bar_class,
    terminal_progress_bar,
)

ROOT = Path(__file__).resolve().parents[2]
TABLE = "lightning_dp.lightning.callbacks.EpochTable"
PROGRESS = "lightning_dp.lightning.progress.TrainingProgress"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("bar_class", sorted({EpsilonTQDMProgressBar, epsilon_progress_bar_class()}, key=str))
def test_the_bar_shows_epsilon_to_four_decimals(bar_class) -> None:
    trainer = SimpleNamespace(loggers=[], progress_bar_metrics={"epsilon": 2.99823, "loss": 0.5})
    assert bar_class().get_metrics(trainer, None) == {"epsilon": "2.9982", "loss": 0.5}


def test_a_bar_only_in_a_terminal() -> None:
    assert terminal_progress_bar(io.StringIO()) is None
    assert isinstance(terminal_progress_bar(_Terminal()), epsilon_progress_bar_class())


def _config(*callbacks: str, enable_progress_bar: bool | None = None) -> Namespace:
    listed = [Namespace(class_path=path, init_args=Namespace()) for path in callbacks]
    return Namespace(trainer=Namespace(callbacks=listed, enable_progress_bar=enable_progress_bar))


def _callbacks(config: Namespace) -> list[str]:
    return [callback.class_path for callback in config["trainer.callbacks"]]


def test_fit_in_a_terminal_gets_the_bar_with_four_decimals() -> None:
    config = _config(TABLE)
    choose_progress_display(config, terminal=True)
    bar = epsilon_progress_bar_class()
    assert _callbacks(config) == [TABLE, f"{bar.__module__}.{bar.__qualname__}"]
    assert config["trainer.enable_progress_bar"] is None


def test_fit_in_a_log_file_gets_no_bar_and_progress_lines_unless_a_table_prints_them() -> None:
    with_table, without = _config(TABLE), _config()
    for config in (with_table, without):
        choose_progress_display(config, terminal=False)
        assert config["trainer.enable_progress_bar"] is False
    assert _callbacks(with_table) == [TABLE] and _callbacks(without) == [PROGRESS]


@pytest.mark.parametrize("terminal", [True, False])
def test_fit_keeps_a_configs_own_choice_of_bar(terminal) -> None:
    own_bar = _config(f"{TQDMProgressBar.__module__}.TQDMProgressBar")
    disabled = _config(enable_progress_bar=False)
    for config in (own_bar, disabled):
        before = config.clone()
        choose_progress_display(config, terminal=terminal)
        assert config == before


def test_fit_output_in_a_log_file_has_no_bar_but_a_line_per_logging_step(tmp_path) -> None:
    """``lightning-dp fit`` of the digits config without its epoch table, stdout to a file: no carriage return, no
    bar, the progress lines of every ``log_every_n_steps`` steps."""
    config = yaml.safe_load((ROOT / "configs" / "digits_cnn.yaml").read_text())
    config["trainer"]["callbacks"] = [c for c in config["trainer"]["callbacks"] if "EpochTable" not in c["class_path"]]
    config["trainer"].update(max_steps=10, log_every_n_steps=5, default_root_dir=str(tmp_path), logger=False)
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as stdout, err.open("w") as stderr:
        command = [sys.executable, "-m", "lightning_dp.cli", "fit", "--config", str(path)]
        done = subprocess.run(command, cwd=tmp_path, env=env, stdout=stdout, stderr=stderr, timeout=300)
    assert done.returncode == 0, err.read_text()[-3000:]
    output = out.read_text() + err.read_text()
    assert "\r" not in output and "it/s" not in output and "Epoch 0" not in output
    steps = [line.split(":")[0] for line in output.splitlines() if line.startswith("step ")]
    assert steps == ["step 5/10", "step 10/10"]
