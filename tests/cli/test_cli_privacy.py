"""``lightning-dp epsilon`` / ``calibrate``: JSON output, readable tables, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dp.accounting import ACCOUNTANTS
from lightning_dp.cli.privacy import calibrate_main, epsilon_main, format_table

GAUSS = ["--noise", "gaussian", "--sample-rate", "0.01", "--steps", "1000", "--delta", "1e-5"]


def needs(*names: str) -> pytest.MarkDecorator:
    missing = sorted(set(names) - set(ACCOUNTANTS))
    return pytest.mark.skipif(bool(missing), reason=f"accountants not registered yet: {missing}")


def run_json(main, argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main([*argv, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # exactly one JSON object on stdout
    return json.loads(out)


def test_epsilon_json_gaussian(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(
        epsilon_main, [*GAUSS, "--max-grad-norm", "1", "--noise-multiplier", "1.1", "--accountant", "rdp"], capsys
    )
    assert {"epsilon", "delta", "accountant"} <= set(data)
    assert data["accountant"] == "rdp" and data["delta"] == 1e-5 and 0 < data["epsilon"] < 10
    assert data["noise_multiplier"] == 1.1 and data["epsilons"] == {"rdp": data["epsilon"]}


def test_epsilon_readable_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert epsilon_main([*GAUSS, "--max-grad-norm", "1", "--noise-multiplier", "1.1", "--accountant", "rdp"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any(line.startswith("noise_multiplier") and "1.1" in line for line in lines)
    header = next(line for line in lines if line.startswith("accountant"))
    row = next(line for line in lines if line.startswith("rdp"))
    assert header.index("epsilon") == row.index(row.split()[1])  # aligned columns


def test_calibrate_json_gaussian(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(
        calibrate_main, [*GAUSS, "--target-epsilon", "2", "--accountant", "rdp", "--max-grad-norm", "0.5"], capsys
    )
    assert data["max_grad_norm"] == 0.5 and data["noise_multiplier"] > 0
    assert 0.999 * 2 <= data["epsilon"] <= 2 and data["accountant"] == "rdp"
    assert "pld" in data["epsilons"]  # the mechanism's default accountant is shown too


@pytest.mark.parametrize("sample_rate, steps", [("0.01", "1000"), ("0.1017", "50"), ("0.004", "2500")])
def test_calibrate_lands_within_a_thousandth_below_the_target(
    sample_rate: str, steps: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Calibration for epsilon = 3 under the default (PLD) accountant reports a value in [2.997, 3.0]: never above
    the target, and at most 0.1 % more noise than the target needs."""
    argv = ["--noise", "gaussian", "--sample-rate", sample_rate, "--steps", steps, "--delta", "1e-5"]
    data = run_json(calibrate_main, [*argv, "--target-epsilon", "3"], capsys)
    assert data["accountant"] == "pld" and 2.997 <= data["epsilon"] <= 3.0


def test_missing_noise_parameter_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        epsilon_main([*GAUSS, "--max-grad-norm", "1"])
    assert info.value.code == 2
    assert "--noise-multiplier" in capsys.readouterr().err


def test_invalid_value_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert epsilon_main([*GAUSS, "--max-grad-norm", "-1", "--noise-multiplier", "1"]) == 2
    assert "error: --max-grad-norm must be a positive finite number, got -1.0" in capsys.readouterr().err


def test_search_only_for_lap2_and_plrv(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        calibrate_main([*GAUSS, "--target-epsilon", "1", "--search"])
    assert "--search" in capsys.readouterr().err


def test_format_table_aligns() -> None:
    assert format_table([("a", "bb"), ("ccc", "d")]).splitlines() == ["a    bb", "ccc  d"]


LAP2 = ["--sample-rate", "0.01", "--steps", "300", "--delta", "1e-5", "--num-params", "5000"]


@needs("lap2", "lap2-paper")
def test_epsilon_lap2_paper_and_sound_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--noise", "lap2", *LAP2, "--max-grad-norm", "1", "--noise-scale", "2"]
    data = run_json(epsilon_main, argv, capsys)
    assert data["accountant"] == "lap2" and set(data["epsilons"]) == {"lap2-paper", "lap2"}
    assert epsilon_main(argv) == 0
    out = capsys.readouterr().out
    assert "lap2-paper" in out and "not valid" in out


@needs("plrv", "plrv-paper")
def test_epsilon_plrv_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--noise", "plrv", *LAP2, "--max-grad-norm", "1", "--gamma-shape", "100", "--gamma-scale", "0.01"]
    data = run_json(epsilon_main, argv, capsys)
    assert data["accountant"] == "plrv" and set(data["epsilons"]) == {"plrv-paper", "plrv"}
    assert data["gamma_shape"] == 100 and data["gamma_scale"] == 0.01


@needs("lap2")
def test_calibrate_lap2_json(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(calibrate_main, ["--noise", "lap2", *LAP2, "--target-epsilon", "2"], capsys)
    assert data["noise_scale"] > 0 and data["max_grad_norm"] == 1.0 and 1.98 <= data["epsilon"] <= 2.0
    data = run_json(calibrate_main, ["--noise", "lap2", *LAP2, "--target-epsilon", "2", "--search"], capsys)
    assert data["epsilon"] <= 2.0


@needs("plrv")
def test_calibrate_plrv_json(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(calibrate_main, ["--noise", "plrv", *LAP2, "--target-epsilon", "2"], capsys)
    assert {"gamma_shape", "gamma_scale", "max_grad_norm", "epsilon"} <= set(data)
    assert data["gamma_shape"] > 1 and data["epsilon"] <= 2.0


@needs("basic")
def test_calibrate_laplace_readable(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--noise", "laplace", "--sample-rate", "1", "--steps", "1220", "--delta", "1e-5", "--target-epsilon", "3"]
    assert calibrate_main([*argv, "--max-grad-norm", "3"]) == 0
    out = capsys.readouterr().out
    assert "noise_scale" in out and "basic" in out


def test_dispatch_from_console_entry(capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_dp.cli.main import main

    argv = ["epsilon", *GAUSS, "--max-grad-norm", "1", "--noise-multiplier", "1.1", "--accountant", "rdp", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["accountant"] == "rdp"


def test_calibrate_says_when_the_noise_drowns_the_signal() -> None:
    """``calibrate --target-epsilon 1e-4`` (sigma in the hundreds of thousands) prints a warning on stderr, in a plain
    process without logging set-up, beside the table on stdout."""
    root = Path(__file__).resolve().parents[2]
    argv = ["calibrate", "--noise", "gaussian", "--target-epsilon", "1e-4", "--delta", "1e-5"]
    argv += ["--sample-rate", "0.05", "--steps", "100", "--accountant", "rdp"]
    probe = f"import sys; from lightning_dp.cli.main import main; sys.exit(main({argv!r}))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "learn nothing useful" in done.stderr and "noise_multiplier" in done.stdout
