"""``lightning-dp epsilon`` / ``calibrate`` with ``--noise-correlation banded``: the ``banded-mf`` epsilon of the
strategy a run of ``--steps`` planned steps uses, against the accountant called directly and DP-SGD at ``b = 1``; with
``--noise-correlation blt``, the ``blt-minsep`` epsilon against the analytic Gaussian mechanism."""

from __future__ import annotations

import json
import math

import pytest
from correlation_helpers import analytic_gaussian_epsilon

from lightning_dp.accounting.banded_mf import band_and_max_column_norm, banded_mf_epsilon
from lightning_dp.cli.privacy import calibrate_main, epsilon_main
from lightning_dp.correlated_noise import optimize_banded
from lightning_dp.mechanisms.calibration import mechanism_epsilon
from lightning_dp.mechanisms.gaussian import GaussianMechanism

SCHEDULE = ["--noise", "gaussian", "--sample-rate", "0.01", "--steps", "120", "--delta", "1e-5"]


def banded(band: int) -> list[str]:
    return ["--noise-correlation", "banded", "--correlation-band", str(band)]


def run_json(main, argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_epsilon_is_the_accountants_for_the_runs_strategy(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(epsilon_main, [*SCHEDULE, "--max-grad-norm", "1", "--noise-multiplier", "1.2", *banded(4)], capsys)
    strategy = optimize_banded(120, 4, max_participations=1)
    _, column_norm = band_and_max_column_norm(strategy, 120)
    expected = banded_mf_epsilon(
        strategy, steps=120, noise_multiplier=1.2 * column_norm, group_sample_rate=0.04, delta=1e-5, num_groups=4
    )
    assert data["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert data["accountant"] == "banded-mf" and data["epsilons"] == {"banded-mf": data["epsilon"]}
    assert (data["correlation_band"], data["group_sample_rate"], data["participations"]) == (4, 0.04, 30)
    assert data["max_column_norm"] == pytest.approx(column_norm) and data["expected_abs_noise"] is None


def test_band_one_is_dp_sgd(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(epsilon_main, [*SCHEDULE, "--max-grad-norm", "1", "--noise-multiplier", "1.2", *banded(1)], capsys)
    dp_sgd = mechanism_epsilon(
        GaussianMechanism(1.2, 1.0), sample_rate=0.01, steps=120, delta=1e-5, num_params=None, accountant="pld"
    )
    assert data["max_column_norm"] == 1.0 and data["epsilon"] == pytest.approx(dp_sgd, rel=1e-9)


def test_calibrate_lands_below_the_target_and_epsilon_agrees(capsys: pytest.CaptureFixture[str]) -> None:
    data = run_json(calibrate_main, [*SCHEDULE, "--target-epsilon", "2", *banded(4)], capsys)
    assert 0.999 * 2 <= data["epsilon"] <= 2 and data["accountant"] == "banded-mf"
    sigma = str(data["noise_multiplier"])
    again = run_json(epsilon_main, [*SCHEDULE, "--max-grad-norm", "1", "--noise-multiplier", sigma, *banded(4)], capsys)
    assert again["epsilon"] == pytest.approx(data["epsilon"], rel=1e-9)


def test_plot_draws_the_banded_curve(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "eps.png"
    argv = [*SCHEDULE, "--max-grad-norm", "1", "--noise-multiplier", "1.2", *banded(4), "--plot", str(plot)]
    assert epsilon_main(argv) == 0
    assert plot.stat().st_size > 0


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--correlation-band", "4"], "--correlation-band applies to --noise-correlation banded"),
        (["--noise-correlation", "banded"], "needs --correlation-band B"),
        ([*banded(4), "--accountant", "pld"], "accounted by --accountant banded-mf only"),
        ([*banded(4), "--clipping", "hutch", "--norm-dim", "8"], "not accounted with --clipping hutch"),
        ([*banded(121)], "--correlation-band 121 exceeds --steps 120"),
        ([*banded(101)], "b*q=1.01 > 1"),
        (["--noise-correlation", "toeplitz"], "invalid choice 'toeplitz'"),
        (
            ["--noise-correlation", "blt", "--correlation-band", "4"],
            "--correlation-band applies to --noise-correlation banded",
        ),
        (["--correlation-buffers", "4"], "--correlation-buffers applies to --noise-correlation blt"),
        (["--accountant", "banded-mf"], "accounts for correlated noise only; add --noise-correlation banded"),
    ],
)
def test_bad_banded_arguments_are_one_line(extra: list[str], message: str, capsys) -> None:
    argv = [*SCHEDULE, "--max-grad-norm", "1", "--noise-multiplier", "1.2", *extra]
    with pytest.raises(SystemExit) as info:
        epsilon_main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_banded_noise_is_gaussian_only(capsys) -> None:
    argv = ["--noise", "laplace", "--sample-rate", "0.01", "--steps", "120", "--delta", "1e-5", "--max-grad-norm"]
    with pytest.raises(SystemExit) as info:
        epsilon_main([*argv, "1", "--noise-scale", "1", *banded(4)])
    assert info.value.code == 2
    assert "correlates Gaussian noise (got --noise laplace)" in capsys.readouterr().err


def test_blt_epsilon_is_k_unamplified_gaussian_steps(capsys: pytest.CaptureFixture[str]) -> None:
    """``--noise-correlation blt`` at q = 0.01 over 120 steps: b = 100 groups, k = 2, so epsilon is the Gaussian
    mechanism with mu = sqrt(2) / sigma (the noise is scaled by sens(C) / sqrt(k)); calibrate lands below a target."""
    argv = [*SCHEDULE, "--max-grad-norm", "1", "--noise-multiplier", "3", "--noise-correlation", "blt"]
    data = run_json(epsilon_main, argv, capsys)
    assert data["accountant"] == "blt-minsep" and data["num_groups"] == 100 and data["participations"] == 2
    assert data["correlation_buffers"] == 4 and data["noise_scale_factor"] > 0
    expected = analytic_gaussian_epsilon(math.sqrt(2) / 3, 1e-5)
    assert expected * (1 - 1e-9) <= data["epsilon"] <= expected * (1 + 2e-3)
    argv = [*SCHEDULE, "--target-epsilon", "2", "--noise-correlation", "blt", "--correlation-buffers", "2"]
    calibrated = run_json(calibrate_main, argv, capsys)
    assert 0.999 * 2 <= calibrated["epsilon"] <= 2 and calibrated["correlation_buffers"] == 2
