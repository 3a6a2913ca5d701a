"""The ``lightning-dp`` console entry: help, LightningCLI ``fit`` with the shipped config."""

from pathlib import Path

import pytest
import yaml

from lightning_dp.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


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


def test_fit_saves_each_runs_config_in_its_own_folder_and_never_overwrites(tmp_path, capsys):
    """Two runs of the same config in one root: each run's config.yaml lands in its own versioned log folder; a
    config without a logger (one folder for every run) is refused on the second run rather than overwritten."""
    config = yaml.safe_load(CONFIGS[0].read_text())
    config["trainer"].update(max_steps=1, default_root_dir=str(tmp_path), enable_progress_bar=False)
    path = tmp_path / "digits.yaml"
    path.write_text(yaml.safe_dump(config))
    for _ in range(2):
        assert main(["fit", "--config", str(path)]) == 0
    saved = sorted(tmp_path.rglob("config.yaml"))
    assert [p.parent.name for p in saved] == ["version_0", "version_1"]
    assert yaml.safe_load(saved[1].read_text())["trainer"]["max_steps"] == 1
    config["trainer"]["logger"] = False
    path.write_text(yaml.safe_dump(config))
    (tmp_path / "config.yaml").write_text("kept: true\n")
    capsys.readouterr()
    assert main(["fit", "--config", str(path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "holds an earlier run's config" in line and "--trainer.default_root_dir" in line
    assert (tmp_path / "config.yaml").read_text() == "kept: true\n"


def test_demo_reaches_target_accuracy():
    from lightning_dp.cli.demo import run_demo

    result = run_demo(progress_bar=False)
    assert result["epsilon"] <= 3.0 + 1e-9
    assert result["test_acc"] >= 0.85
