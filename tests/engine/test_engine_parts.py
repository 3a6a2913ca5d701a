"""The privacy engine's parts share one run state: what a part fixes at construction stays fixed, a restore clears
what the ledger cached, and the accounting of randomized and adaptive clipping reads the engine and the mechanism by
their documented attributes (``randomized``, ``estimator``, ``projection_dim``; ``noise_multiplier``), not by class."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dp.accounting.events import GaussianEvent, PoissonSampledEvent
from lightning_dp.clipping import ENGINES, ClippingEngine, register_engine
from lightning_dp.clipping.engines.hutch import HutchEngine
from lightning_dp.clipping.terms import Term
from lightning_dp.engine import PrivacyEngine
from lightning_dp.mechanisms import NoiseMechanism


def _prepared(engine: PrivacyEngine, *, steps: int = 0, sample_rate: float = 0.01) -> PrivacyEngine:
    engine.attach(nn.Linear(4, 2))
    engine.prepare(num_samples=1000, sample_rate=sample_rate, total_steps=100)
    for _ in range(steps):
        engine.record_step()
    return engine


class DuckHutchEngine(ClippingEngine):
    """A randomized engine written from the documented attributes alone, not as a ``RandomizedEngine``."""

    name = "duck-hutch"
    randomized = True
    estimator = "hutch"

    def __init__(self, projection_dim: int) -> None:
        self.projection_dim = projection_dim
        self._hutch = HutchEngine(projection_dim)

    def contribution(self, terms: list[Term], norm: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return self._hutch.contribution(terms, norm, generator)


def test_a_randomized_engine_is_accounted_by_its_attributes_not_its_class() -> None:
    register_engine(DuckHutchEngine)
    try:
        duck = _prepared(PrivacyEngine(max_grad_norm=1.0, noise_multiplier=1.0, clipping="duck-hutch"), steps=3)
        hutch = _prepared(PrivacyEngine(max_grad_norm=1.0, noise_multiplier=1.0, clipping="hutch"), steps=3)
    finally:
        ENGINES.remove(DuckHutchEngine.name)
    assert duck.accountant is not None and duck.accountant.name == "rc"
    assert duck.step_event() == hutch.step_event()
    assert duck.epsilon() == hutch.epsilon()
    assert duck.summary()["projection_dim"] == hutch.summary()["projection_dim"] == 32


class PlainGaussian(NoiseMechanism):
    """A mechanism given as an instance under the name ``"gaussian"`` that does not subclass GaussianMechanism."""

    name = "gaussian"
    default_accountant = "rdp"

    def __init__(self, noise_multiplier: float, max_grad_norm: float) -> None:
        super().__init__(max_grad_norm)
        self.noise_multiplier = noise_multiplier

    def sample(self, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        noise = torch.empty_like(like).normal_(generator=generator)
        return noise * (self.noise_multiplier * self.max_grad_norm)

    def step_event(self, sample_rate: float, num_params: int) -> PoissonSampledEvent:
        return PoissonSampledEvent(sample_rate, GaussianEvent(self.noise_multiplier))

    def expected_abs_noise(self) -> float:
        return self.noise_multiplier * self.max_grad_norm * (2 / torch.pi) ** 0.5

    def describe(self) -> dict[str, float]:
        return {"noise_multiplier": self.noise_multiplier, "max_grad_norm": self.max_grad_norm}


@pytest.mark.parametrize("options", [{"clipping": "hutch"}, {"target_unclipped_quantile": 0.5}])
def test_randomized_and_adaptive_clipping_read_noise_multiplier_from_any_gaussian(options: dict[str, object]) -> None:
    engine = _prepared(PrivacyEngine(max_grad_norm=1.0, noise=PlainGaussian(0.8, 1.0), **options), steps=2)
    assert engine.summary()["noise_multiplier"] == 0.8 and engine.epsilon() > 0


def test_randomized_clipping_is_fixed_when_the_engine_is_built() -> None:
    """Removing the engine's registration later (a plugin's teardown) changes neither the events nor the accountant
    of a run already configured."""
    engine = _prepared(PrivacyEngine(max_grad_norm=1.0, noise_multiplier=1.0, clipping="hutch"), steps=1)
    hutch = ENGINES.remove("hutch")
    try:
        engine.record_step()
        assert engine.randomized_clipping and engine.steps == 2 and engine.accountant.name == "rc"
    finally:
        register_engine(hutch)
    assert list(ENGINES).index("hutch") >= 0


def test_a_restore_clears_the_cached_step_budget() -> None:
    """The restored ledger's steps were taken at another rate than the steps the cached budget counted."""
    source = _prepared(PrivacyEngine(max_grad_norm=1.0, noise_multiplier=1.0), steps=50, sample_rate=0.02)
    engine = _prepared(PrivacyEngine(max_grad_norm=1.0, noise_multiplier=1.0))
    engine.set_epsilon_budget(source.epsilon() + 1e-9, configured_in="the test")
    assert not engine.budget_exhausted()  # caches the steps the budget allows, counted from a ledger of 0 steps
    engine.load_state_dict(source.state_dict())
    assert engine.steps == 50 and engine.budget_exhausted()
    assert engine.max_steps_within(source.epsilon() + 1e-9) == 50
