"""What a user sees: one-line CLI errors (exit 2), help texts, name suggestions, quiet and useful log output, the
``fit`` summary, the privacy-curve plots."""

from __future__ import annotations

import argparse
import ast
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import TinyRegressor, make_trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger

from lightning_dp import DPStrategy, PrivacyAccountantCallback
from lightning_dp.accounting import make_accountant
from lightning_dp.accounting.events import GaussianEvent, PoissonSampledEvent
from lightning_dp.cli.main import main
from lightning_dp.engine.privacy_engine import PrivacyEngine
from lightning_dp.lightning.callbacks import privacy_engine_of
from lightning_dp.mechanisms.calibration import calibrate_result
from lightning_dp.utils.help_format import HelpFormatter

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GAUSS = ["--noise", "gaussian", "--sample-rate", "0.01", "--steps", "1000", "--delta", "1e-5"]


def exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as stop:
        return int(stop.code)


# ------------------------------------------------------------------------------------------------ CLI errors
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["demo", "--clipping", "foo"], "--clipping"),
        (["demo", "--noise", "foo"], "--noise"),
        (["demo", "--target-epsilon", "0"], "--target-epsilon"),
        (["demo", "--batch-size", "0"], "--batch-size"),
        (["demo", "--accountant", "pdl"], "did you mean 'pld'?"),
        (["demo", "--epochs", "0"], "--epochs"),
        (["demo", "--target-delta", "2"], "--target-delta must lie in (0, 1)"),
        (["demo", "--noise", "gausian"], "did you mean 'gaussian'?"),
        (
            ["epsilon", *GAUSS, "--max-grad-norm", "1", "--noise-multiplier", "1", "--noise-scale", "3"],
            "does not apply",
        ),
        (["epsilon", *GAUSS, "--max-grad-norm", "1"], "--noise-multiplier"),
        (["epsilon", *GAUSS, "--max-grad-norm", "-1", "--noise-multiplier", "1"], "error: --max-grad-norm must be"),
        (["epsilon", *GAUSS, "--max-grad-norm", "1", "--noise-multiplier", "1", "--accountant", "rpd"], "'rdp'"),
        (["calibrate", *GAUSS, "--target-epsilon", "0"], "error: --target-epsilon must be"),
        (["calibrate", *GAUSS, "--target-epsilon", "1e6"], "or calibrate with --accountant rdp ("),
        (["calibrate", *GAUSS, "--target-epsilon", "1", "--delta", "2"], "error: --delta must lie in"),
        (
            [
                "epsilon",
                "--noise",
                "lap2",
                *GAUSS[2:],
                "--max-grad-norm",
                "1",
                "--num-params",
                "9",
                "--noise-scale",
                "-2",
            ],
            "error: --noise-scale must be a positive finite number, got -2.0. Use calibrate(noise='lap2', ...) or "
            "search_lap2(...) to pick it (lightning-dp calibrate --noise lap2).",
        ),
        (["calibrate", "--noise", "lap3", "--sample-rate", "0.01", "--steps", "10", "--delta", "1e-5"], "'lap2'"),
        (["epsilonn"], "did you mean 'epsilon'?"),
    ],
)
def test_bad_input_is_one_error_line_with_exit_code_2(argv, expected, capsys):
    assert exit_code(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "error:" in lines[0] and expected in lines[0]
    assert "Traceback" not in captured.err + captured.out


@pytest.mark.parametrize("text", ["trainer:\n  max_epochs: foo\n", None])
def test_fit_bad_config_is_one_error_line(text, tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    if text is not None:
        path.write_text(text)
    assert exit_code(["fit", "--config", str(path)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightning-dp fit: error:")


def test_wrong_accountant_for_the_noise_is_one_line(capsys):
    assert exit_code(["demo", "--noise", "laplace", "--accountant", "rdp", "--epochs", "1"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err[-1].startswith("lightning-dp demo: error:") and "rdp" in err[-1]
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("command", ["demo", "epsilon", "calibrate"])
def test_help_describes_every_option(command, capsys):
    assert exit_code([command, "--help"]) == 0
    out = capsys.readouterr().out
    options = [line.split()[0] for line in out.splitlines() if line.startswith("  --")]
    assert len(options) >= 8
    # every option has a description (on its line or the next), and defaults and choices are shown
    blocks = out.split("\n  --")[1:]
    assert all(len(block.split()) > 2 for block in blocks), out
    assert "(default:" in out and "{gaussian," in out


def test_top_level_help_lists_commands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("demo", "fit", "epsilon", "calibrate"))


# ------------------------------------------------------------------------------------------------ names
@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        (dict(noise_multiplier=1.0, noise="gausian"), r"(?i)unknown noise 'gausian' \(did you mean 'gaussian'\?\)"),
        (dict(noise_multiplier=1.0, accountant="pdl"), r"(?i)unknown accountant 'pdl' \(did you mean 'pld'\?\)"),
        (dict(noise_multiplier=1.0, clipping="gohst"), r"did you mean 'ghost'\?"),
    ],
)
def test_misspelt_names_suggest_the_closest(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        DPStrategy(**kwargs)


@pytest.mark.parametrize(
    ("noise", "params", "foreign"),
    [("gaussian", {"noise_scale": 3.0}, "noise_scale"), ("lap2", {"noise_multiplier": 1.0}, "noise_multiplier")],
)
def test_noise_params_that_do_not_apply_are_rejected(noise, params, foreign):
    with pytest.raises(ValueError, match=rf"{foreign} does not apply to noise='{noise}'"):
        DPStrategy(noise=noise, noise_params=params)


# ------------------------------------------------------------------------------------------------ calibrate
def test_calibrate_refuses_a_meaningless_target_within_seconds():
    with pytest.raises(ValueError, match=r"no meaningful privacy.*accountant='rdp'"):
        calibrate_result(
            "gaussian", target_epsilon=1e6, target_delta=1e-5, sample_rate=0.01, steps=1000, max_grad_norm=1.0
        )
    rdp = calibrate_result(
        "gaussian",
        target_epsilon=1e3,
        target_delta=1e-5,
        sample_rate=0.01,
        steps=1000,
        max_grad_norm=1.0,
        accountant="rdp",
    )
    assert rdp.epsilon <= 1e3 and 0 < rdp.mechanism.noise_multiplier < 0.3


# ------------------------------------------------------------------------------------------------ log output
def test_rdp_convergence_lines_are_filtered_but_other_absl_warnings_are_not(caplog):
    event = PoissonSampledEvent(0.101749, GaussianEvent(1.029309))
    with caplog.at_level(logging.WARNING):
        eps = make_accountant("rdp").compose(event, 20).get_epsilon(1e-5)
        logging.getLogger("absl").warning("a user's own absl warning")
    assert 0 < eps < 10
    messages = [r.getMessage() for r in caplog.records]
    assert not any("failed to converge" in m for m in messages)
    assert "a user's own absl warning" in messages


def _prepared_engine(**kwargs) -> PrivacyEngine:
    engine = PrivacyEngine(max_grad_norm=1.0, noise_multiplier=kwargs.pop("noise_multiplier", 1.0), **kwargs)
    engine.attach(TinyRegressor())
    engine.prepare(num_samples=64, sample_rate=0.125, total_steps=None)
    return engine


def test_guarantee_defaults_are_in_the_startup_block():
    lines = _prepared_engine().startup_lines()
    first = next(i for i, line in enumerate(lines) if "defaults applied" in line)
    assert "target_delta = 1/N^1.1" in lines[first] and "accountant = 'pld'" in lines[first + 1]


def test_zero_noise_warns_and_reports_infinite_epsilon(caplog):
    with caplog.at_level(logging.WARNING, logger="lightning_dp"):
        engine = _prepared_engine(noise_multiplier=0.0)
    assert any("NOT differentially private" in r.getMessage() for r in caplog.records)
    engine.record_step()
    assert engine.epsilon() == float("inf")


def test_resume_with_another_delta_logs_the_change(caplog):
    engine = _prepared_engine(target_delta=1e-5)
    engine.record_step()
    state = engine.state_dict()
    resumed = PrivacyEngine(max_grad_norm=1.0, noise_multiplier=1.0, target_delta=1e-6)
    with caplog.at_level(logging.WARNING, logger="lightning_dp"):
        resumed.load_state_dict(state)
    (record,) = [r for r in caplog.records if "target_delta changed" in r.getMessage()]
    assert "1e-05" in record.getMessage() and "1e-06" in record.getMessage()


class _BarEpsilon(Callback):
    """Reads the progress bar's metrics where the bar itself reads them at the end of an epoch."""

    def __init__(self) -> None:
        self.seen: list[tuple[float, float]] = []

    def on_train_epoch_end(self, trainer, pl_module):
        bar = trainer.progress_bar_metrics["epsilon"]
        self.seen.append((float(bar), privacy_engine_of(trainer).epsilon()))


def test_progress_bar_epsilon_is_the_current_one():
    recorder = _BarEpsilon()
    strategy = DPStrategy(noise_multiplier=1.2, max_grad_norm=1.0, seed=0)
    trainer = make_trainer(strategy, max_epochs=3, callbacks=[PrivacyAccountantCallback(), recorder])
    trainer.fit(TinyRegressor())
    assert len(recorder.seen) == 3
    for bar, current in recorder.seen:
        assert bar == pytest.approx(current)


# ------------------------------------------------------------------------------------------------ plots
def test_epsilon_plot_is_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "eps.png"
    argv = [*GAUSS[:5], "100", *GAUSS[6:], "--max-grad-norm", "1", "--noise-multiplier", "1.1", "--accountant", "rdp"]
    assert main(["epsilon", *argv, "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert str(path) in capsys.readouterr().err


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    argv = [
        "--max-grad-norm",
        "1",
        "--noise-multiplier",
        "1.1",
        "--accountant",
        "rdp",
        "--plot",
        str(tmp_path / "e.png"),
    ]
    assert main(["epsilon", *GAUSS, *argv]) == 1
    assert "pip install 'lightning_dp[plot]'" in capsys.readouterr().err


class _ImageLogger(Logger):
    """A logger with ``log_image`` (as WandbLogger), recording what it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[tuple[str, list, int]] = []

    @property
    def name(self) -> str:
        return "images"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        pass

    def log_image(self, key, images, step=None, **kwargs) -> None:
        self.images.append((key, images, step))


def test_callback_logs_the_privacy_curve_image_and_warns_on_infinite_epsilon(caplog):
    pytest.importorskip("matplotlib")
    logger = _ImageLogger()
    strategy = DPStrategy(noise_multiplier=0.0, max_grad_norm=1.0, seed=0)
    trainer = make_trainer(strategy, max_epochs=2, logger=logger, callbacks=[PrivacyAccountantCallback()])
    with caplog.at_level(logging.WARNING, logger="lightning_dp"):
        trainer.fit(TinyRegressor())
    ((key, (image,), step),) = logger.images
    assert key == "privacy/epsilon_curve" and step == trainer.global_step
    assert image.dtype.name == "uint8" and image.ndim == 3 and image.shape[2] == 3
    assert any("epsilon is infinite" in r.getMessage() for r in caplog.records)


def test_tensorboard_logger_gets_a_figure(monkeypatch):
    pytest.importorskip("matplotlib")
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_dp.utils.plots import epsilon_curve_figure, log_figure

    figures = []

    class Writer:
        def add_figure(self, tag, figure, global_step=None):
            figures.append((tag, figure, global_step))

    monkeypatch.setattr(TensorBoardLogger, "experiment", property(lambda self: Writer()))
    logger = TensorBoardLogger.__new__(TensorBoardLogger)
    assert log_figure(logger, "privacy/epsilon_curve", epsilon_curve_figure({"pld": ([0, 1], [0, 1])}, delta=1e-5), 7)
    assert [(tag, step) for tag, _, step in figures] == [("privacy/epsilon_curve", 7)]


# ------------------------------------------------------------------------------------------------ fit output
def test_fit_prints_the_summary_and_no_third_party_noise(tmp_path):
    config = yaml.safe_load((ROOT / "configs" / "digits_cnn.yaml").read_text())
    config["trainer"].update(max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False)
    path = tmp_path / "digits.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "default"}
    done = subprocess.run(
        [sys.executable, "-m", "lightning_dp.cli", "fit", "--config", str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert output.count("DP training start-up:") == 1 and "calibrated for epsilon=" in output
    assert "Privacy summary: epsilon=" in output
    for noise in ("absl", "failed to converge", "LightningCLI's args", "LeafSpec", "GPU available", "Tip:"):
        assert noise not in output, output


def test_fit_without_the_callback_still_prints_the_summary(tmp_path, capfd):
    config = yaml.safe_load((ROOT / "configs" / "digits_cnn.yaml").read_text())
    config["trainer"].update(max_epochs=1, default_root_dir=str(tmp_path), enable_progress_bar=False, callbacks=[])
    path = tmp_path / "digits.yaml"
    path.write_text(yaml.safe_dump(config))
    logging.getLogger("lightning_dp").addHandler(handler := logging.StreamHandler(sys.stderr))
    try:
        assert main(["fit", "--config", str(path)]) == 0
    finally:
        logging.getLogger("lightning_dp").removeHandler(handler)
    assert "Privacy summary: epsilon=" in capfd.readouterr().err


def test_every_scripts_help_shows_the_defaults() -> None:
    """Every ``argparse`` parser of the examples and benches uses the package's HelpFormatter, which appends each
    option's default to its help (the ``lightning-dp`` commands use it through ``lightning_dp.cli.args.Parser``)."""
    root = Path(__file__).resolve().parents[2]
    scripts = [*root.glob("bench/*.py"), *root.glob("lightning_dp/examples/*.py")]
    parsers = 0
    for script in scripts:
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "ArgumentParser":
                parsers += 1
                formatter = {k.arg: k.value for k in node.keywords}.get("formatter_class")
                assert isinstance(formatter, ast.Name) and formatter.id == "HelpFormatter", script.name
    assert parsers >= 10
    parser = argparse.ArgumentParser(prog="x", formatter_class=HelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=None, help="seed")
    text = parser.format_help()
    assert "optimizer steps (default: 100)" in text and "seed (default" not in text


def test_a_plain_script_shows_no_advert_and_no_pytree_deprecation(tmp_path) -> None:
    """A plain script training with DPStrategy (no logging or warnings set-up), with Lightning's default logger and
    checkpoints: Lightning's own lines stay; its adverts (the cloud logger, the model registry's checkpoint uploads)
    and the ``_pytree`` deprecation torch raises for it do not."""
    root = Path(__file__).resolve().parents[2]
    script = (
        "import lightning.pytorch as pl\n"
        "from helpers import TinyRegressor\n"
        "from lightning_dp import DPStrategy\n"
        "trainer = pl.Trainer(strategy=DPStrategy(noise_multiplier=1.0, seed=0), max_epochs=1, accelerator='cpu',\n"
        "                     enable_progress_bar=False)\n"
        "trainer.fit(TinyRegressor())\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "GPU available" in output  # Lightning's own information is kept
    assert list(tmp_path.glob("lightning_logs/*/checkpoints/*.ckpt"))  # the checkpoint the advert is about
    assert "💡" not in output and "litlogger" not in output and "litmodels" not in output
    assert "LeafSpec" not in output


def test_demo_output_in_log_files_keeps_the_table_on_its_own_lines(tmp_path) -> None:
    """``lightning-dp demo`` with stdout and stderr redirected to files, as in a batch job: no progress bar (no carriage
    return, no bar line), one line per epoch with epsilon to the digits of the final line, and stderr holds our lines
    without Lightning's device lines."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as stdout, err.open("w") as stderr:
        command = [sys.executable, "-m", "lightning_dp.cli", "demo", "--epochs", "2"]
        done = subprocess.run(command, cwd=tmp_path, env=env, stdout=stdout, stderr=stderr, timeout=300)
    assert done.returncode == 0, err.read_text()
    text = out.read_text()
    assert "\r" not in text and "it/s" not in text
    lines = text.splitlines()
    assert lines[0].split() == ["epoch", "train_loss", "val_acc", "epsilon"]
    rows = [line for line in lines if line.split() and line.split()[0] in ("0", "1")]
    assert len(rows) == 2 and all(len(row.split()) == 4 for row in rows)
    assert lines == [lines[0], *rows, lines[-1]]  # the header, one row per epoch, the result: nothing else
    assert "(gaussian, mixed clipping, " in lines[-1]  # the engine the default clipping="auto" resolved to
    assert f"at epsilon {rows[-1].split()[-1]}, " in lines[-1]  # the table's digits
    log = err.read_text()
    assert "DP training start-up" in log and "Privacy summary" in log
    assert "clipping = 'mixed' with book-keeping (auto: the fastest exact engine for an l2 mechanism)" in log
    assert "GPU available" not in log and "litlogger" not in log and "\r" not in log
