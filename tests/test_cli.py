"""The ``lightning-dp`` console entry: help, LightningCLI ``fit`` with the shipped config."""

from pathlib import Path

import pytest
import yaml

from lightning_dp.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("demo", "fit", "epsilon", "calibrate"):
        assert command in out
    assert main(["nope"]) == 2


CONFIGS = sorted((ROOT / "configs").glob("digits_*.yaml"))


def test_one_config_per_mechanism():
    from lightning_dp.mechanisms import MECHANISMS

    noises = {yaml.safe_load(p.read_text())["trainer"]["strategy"]["init_args"]["noise"] for p in CONFIGS}
    assert noises == set(MECHANISMS)


@pytest.mark.parametrize("config_path", CONFIGS, ids=lambda p: p.stem)
def test_fit_with_shipped_config(config_path, tmp_path, capsys):
    config = yaml.safe_load(config_path.read_text())
    config["trainer"]["max_epochs"] = 1
    config["trainer"]["default_root_dir"] = str(tmp_path)
    config["trainer"]["enable_progress_bar"] = False
    path = tmp_path / "digits.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["fit", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "epsilon" in out


def test_demo_reaches_target_accuracy():
    from lightning_dp.demo import run_demo

    result = run_demo(progress_bar=False)
    assert result["epsilon"] <= 3.0 + 1e-9
    assert result["test_acc"] >= 0.85
