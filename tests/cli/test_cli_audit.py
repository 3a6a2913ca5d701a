"""``lightning-dp audit``: JSON output, exit codes, bad values."""

import json

import pytest
import torch

from lightning_dp.cli.main import main, usage


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_audit_prints_one_json_object_and_exits_0_when_the_bound_holds(capsys):
    assert "audit" in usage()
    code = main(["audit", "--target-epsilon", "2", "--canaries", "200", "--epochs", "2", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0
    assert result["num_canaries"] == 200 and result["confidence"] == 0.95 and result["steps"] == 20
    assert result["epsilon_lower_bound"] < result["reported_epsilon"] and not result["violated"]
    assert result["clipping"] == "mixed"  # the engine the default clipping="auto" ran


def test_audit_clipped_gradient_mode(capsys):
    argv = ["audit", "--mode", "clipped-gradient", "--target-epsilon", "2", "--canaries", "200", "--epochs", "2"]
    code = main([*argv, "--canary-norm", "5", "--clipping", "ghost", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["mode"] == "clipped-gradient" and result["num_canaries"] == 200
    assert result["clipping"] == "ghost"
    assert main([*argv, "--canary-norm", "1"]) == 2
    assert "canary_norm must exceed 1" in capsys.readouterr().err
    assert main(["audit", "--setup", "digits", "--mode", "clipped-gradient", "--target-epsilon", "2"]) == 2
    assert "unused input features" in capsys.readouterr().err


def test_audit_rejects_bad_values(capsys):
    assert main(["audit", "--target-epsilon", "2", "--canaries", "0"]) == 2
    assert "num_canaries must be >= 1" in capsys.readouterr().err
    assert main(["audit", "--target-epsilon", "2", "--canaries", "5000"]) == 2
    assert "distinct coordinates" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["audit", "--target-epsilon", "2", "--setup", "resnet"])
