"""A mechanism registered from outside the library is calibrated, trained with and listed like the built-in ones.

The toy mechanism lives in this file only: Gaussian noise whose privacy event is a Gaussian event with a scaled
noise multiplier. Nothing in the library names it, so calibration (``calibrate`` / ``calibrate_result`` and
``PrivacyEngine(target_epsilon=...)``), secure-mode checks and the command line must all go through the registry.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from lightning_dp.accounting.events import GaussianEvent, PoissonSampledEvent
from lightning_dp.cli.privacy import calibrate_main, epsilon_main, noises
from lightning_dp.engine.privacy_engine import PrivacyEngine
from lightning_dp.mechanisms import MECHANISMS, NoiseMechanism, calibrate, calibrate_result, register_mechanism
from lightning_dp.mechanisms.calibration import RTOL, mechanism_epsilon, resolve_accountant
from lightning_dp.mechanisms.secure import check_secure_mechanism

#: the toy's event is that of a Gaussian mechanism with multiplier SCALE * toy_multiplier.
SCALE = 2.0
TARGET = dict(target_epsilon=2.0, target_delta=1e-5, sample_rate=0.01, steps=500)


class ToyMechanism(NoiseMechanism):
    """``N(0, (SCALE * toy_multiplier * C)^2)`` per coordinate (a Gaussian mechanism by another parameter)."""

    name = "toy"
    default_accountant = "rdp"
    calibrated_parameter = "toy_multiplier"
    parameter_help = {"toy_multiplier": "toy noise multiplier"}

    def __init__(self, toy_multiplier: float, max_grad_norm: float) -> None:
        super().__init__(max_grad_norm)
        self.toy_multiplier = float(toy_multiplier)

    def sample(self, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        noise = torch.empty_like(like).normal_(generator=generator)
        return noise * (SCALE * self.toy_multiplier * self.max_grad_norm)

    def step_event(self, sample_rate: float, num_params: int) -> PoissonSampledEvent:
        return PoissonSampledEvent(sample_rate, GaussianEvent(SCALE * self.toy_multiplier))

    def expected_abs_noise(self) -> float:
        return SCALE * self.toy_multiplier * self.max_grad_norm * (2 / torch.pi) ** 0.5

    def describe(self) -> dict[str, float]:
        return {"toy_multiplier": self.toy_multiplier, "max_grad_norm": self.max_grad_norm}


@pytest.fixture
def toy() -> Iterator[type[ToyMechanism]]:
    """Register the toy for one test only (other tests compare the registry with the shipped mechanisms)."""
    register_mechanism(ToyMechanism)
    try:
        yield ToyMechanism
    finally:
        MECHANISMS.remove(ToyMechanism.name)


def test_calibrate_a_registered_toy_through_the_generic_path(toy: type[ToyMechanism]) -> None:
    assert resolve_accountant("toy") == "rdp"
    result = calibrate_result("toy", **TARGET, max_grad_norm=1.5)
    mech = result.mechanism
    assert isinstance(mech, ToyMechanism) and mech.max_grad_norm == 1.5 and result.accountant == "rdp"
    eps = mechanism_epsilon(mech, sample_rate=0.01, steps=500, delta=1e-5)
    assert (1 - RTOL) * 2.0 <= eps <= 2.0 and eps == pytest.approx(result.epsilon)
    # the same guarantee as the Gaussian mechanism with sigma = SCALE * toy_multiplier
    gauss = calibrate("gaussian", **TARGET, max_grad_norm=1.0, accountant="rdp")
    assert SCALE * mech.toy_multiplier == pytest.approx(gauss.noise_multiplier, rel=2 * RTOL)
    assert calibrate("toy", **TARGET, max_grad_norm=1.0).describe()["toy_multiplier"] == mech.toy_multiplier


def test_privacy_engine_calibrates_the_toy(toy: type[ToyMechanism]) -> None:
    engine = PrivacyEngine(max_grad_norm=1.0, target_epsilon=2.0, target_delta=1e-5, noise="toy", seed=0)
    model = nn.Linear(3, 2)
    engine.attach(model)
    engine.prepare(num_samples=1000, sample_rate=0.01, total_steps=500)
    assert isinstance(engine.mechanism, ToyMechanism) and engine.accountant.name == "rdp"
    eps = mechanism_epsilon(engine.mechanism, sample_rate=0.01, steps=500, delta=1e-5)
    assert (1 - RTOL) * 2.0 <= eps <= 2.0
    optimizer = engine.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert optimizer.mechanism is engine.mechanism


def test_toy_has_no_secure_sampler(toy: type[ToyMechanism]) -> None:
    with pytest.raises(ValueError, match="secure_mode=True has samplers for noise in .*not 'toy'"):
        check_secure_mechanism("toy")
    with pytest.raises(ValueError, match="not 'toy'"):
        ToyMechanism(1.0, 1.0).secure_sample(torch.zeros(3), torch.Generator())


def test_cli_lists_and_uses_the_toy(toy: type[ToyMechanism], capsys: pytest.CaptureFixture[str]) -> None:
    assert "toy" in noises()
    schedule = ["--noise", "toy", "--sample-rate", "0.01", "--steps", "500", "--delta", "1e-5", "--json"]
    assert calibrate_main([*schedule, "--target-epsilon", "2"]) == 0
    calibrated = json.loads(capsys.readouterr().out)
    assert calibrated["accountant"] == "rdp" and calibrated["epsilon"] <= 2.0
    argv = [*schedule, "--max-grad-norm", "1", "--toy-multiplier", str(calibrated["toy_multiplier"])]
    assert epsilon_main(argv) == 0
    assert json.loads(capsys.readouterr().out)["epsilons"] == {"rdp": pytest.approx(calibrated["epsilon"])}
    with pytest.raises(SystemExit):
        epsilon_main([*schedule, "--max-grad-norm", "1", "--noise-multiplier", "1"])
    assert "--noise toy needs --toy-multiplier" in capsys.readouterr().err


def test_the_toy_is_gone_after_its_tests() -> None:
    assert "toy" not in MECHANISMS and "toy" not in noises()
