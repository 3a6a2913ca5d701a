"""Extending the library from outside it (docs/design.md section 10.1): each toy below lives in this file only, is
registered by a fixture and removed again afterwards, and trains through both adapters (Lightning ``DPStrategy``
and HF ``DPTrainer``) with no other edit.

1. a noise mechanism with its own event type and its own accountant (``toy`` and ``toy-zcdp``);
2. a clipping engine (``toy-flat``), and a randomized one (``toy-hutch``) whose accounting follows the
   ``randomized`` flag, not the name;
3. a layer family (``Scale``, ``y = x * weight``), whose per-sample norms match the torch.func oracle.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator

import pytest
import torch
from clipping_helpers import ENGINES as CLIPPING_ENGINES
from clipping_helpers import check_against_oracle, lm_loss, rand, randomise
from helpers import TinyRegressor, make_trainer
from hf_helpers import make_trainer as make_hf_trainer
from hf_helpers import tiny_gpt2, trainable_snapshot
from torch import nn

from lightning_dp import DPStrategy
from lightning_dp.accounting import ACCOUNTANTS, Accountant, make_accountant, register_accountant, register_event
from lightning_dp.accounting.events import _EVENT_TYPES
from lightning_dp.clipping import ENGINES, ClippingEngine, register_engine, register_layer
from lightning_dp.clipping.engines.base import gradient_contribution
from lightning_dp.clipping.engines.hutch import RandomizedEngine
from lightning_dp.clipping.engines.projection import GradientOperator
from lightning_dp.clipping.layers.registry import _BY_TYPE
from lightning_dp.clipping.terms import Materialised, Term, compute_dtype, materialise_sum
from lightning_dp.hf import PrivacyArguments
from lightning_dp.mechanisms import MECHANISMS, NoiseMechanism, calibrate_result, register_mechanism
from lightning_dp.mechanisms.calibration import RTOL

DELTA = 1e-3


# ================================================================================ 1. a mechanism and its accountant


@dataclasses.dataclass(frozen=True)
class ToyEvent:
    """One step of the toy mechanism: Gaussian noise of std ``noise_multiplier * C`` on an l2-clipped sum (the
    sampling rate is recorded but the toy accountant does not use it)."""

    noise_multiplier: float
    sample_rate: float


class ToyMechanism(NoiseMechanism):
    """``N(0, (toy_sigma * C)^2)`` per coordinate, accounted by ``toy-zcdp``."""

    name = "toy"
    default_accountant = "toy-zcdp"
    calibrated_parameter = "toy_sigma"
    parameter_help = {"toy_sigma": "toy noise multiplier"}

    def __init__(self, toy_sigma: float, max_grad_norm: float) -> None:
        super().__init__(max_grad_norm)
        if not toy_sigma > 0:
            raise ValueError(f"toy_sigma must be positive, got {toy_sigma}")
        self.toy_sigma = float(toy_sigma)

    def sample(self, like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        return torch.empty_like(like).normal_(generator=generator) * (self.toy_sigma * self.max_grad_norm)

    def step_event(self, sample_rate: float, num_params: int) -> ToyEvent:
        return ToyEvent(self.toy_sigma, sample_rate)

    def expected_abs_noise(self) -> float:
        return self.toy_sigma * self.max_grad_norm * math.sqrt(2 / math.pi)

    def describe(self) -> dict[str, float]:
        return {"toy_sigma": self.toy_sigma, "max_grad_norm": self.max_grad_norm}


def zcdp_epsilon(ledger: list[tuple[float, int]], delta: float) -> float:
    """``rho + 2 sqrt(rho log(1/delta))`` with ``rho = sum count / (2 sigma^2)``: each Gaussian step is
    ``1/(2 sigma^2)``-zCDP (sampling only helps and is ignored), zCDP composes by addition, and rho-zCDP implies
    that (epsilon, delta)-DP (Bun & Steinke 2016, Prop. 1.3)."""
    rho = sum(count / (2 * sigma**2) for sigma, count in ledger)
    return rho + 2 * math.sqrt(rho * math.log(1 / delta))


class ToyZcdpAccountant(Accountant):
    """Composes :class:`ToyEvent` s in zCDP (see :func:`zcdp_epsilon`)."""

    name = "toy-zcdp"

    def supports(self, event: object) -> bool:
        return isinstance(event, ToyEvent)

    def _epsilon(self, delta: float) -> float:
        return zcdp_epsilon([(event.noise_multiplier, count) for event, count in self.ledger], delta)


@pytest.fixture
def toy_mechanism() -> Iterator[type[ToyMechanism]]:
    """The mechanism, its event type and its accountant, registered for one test."""
    register_event(ToyEvent)
    register_accountant(ToyZcdpAccountant)
    register_mechanism(ToyMechanism)
    try:
        yield ToyMechanism
    finally:
        MECHANISMS.remove(ToyMechanism.name)
        ACCOUNTANTS.remove(ToyZcdpAccountant.name)
        _EVENT_TYPES.remove(ToyEvent.__name__)


def test_toy_mechanism_trains_through_dp_strategy(toy_mechanism: type[ToyMechanism]) -> None:
    sigma = 1.5
    strategy = DPStrategy(noise="toy", noise_params={"toy_sigma": sigma}, target_delta=DELTA, seed=0)
    module = TinyRegressor()
    before = [p.detach().clone() for p in module.parameters()]
    make_trainer(strategy, max_steps=4).fit(module)
    engine = strategy.privacy_engine
    assert isinstance(engine.mechanism, ToyMechanism) and engine.accountant.name == "toy-zcdp"
    assert engine.steps == 4 and engine.accountant.ledger == [[ToyEvent(sigma, engine.sample_rate), 4]]
    assert engine.epsilon() > 0 and engine.epsilon() == pytest.approx(zcdp_epsilon([(sigma, 4)], DELTA), rel=1e-12)
    assert all(not torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))
    # the ledger round-trips through checkpoint state (the event type is registered)
    restored = make_accountant("toy-zcdp")
    restored.load_state_dict(engine.accountant.state_dict())
    assert restored.ledger == engine.accountant.ledger


def test_toy_mechanism_calibrates_through_dp_strategy(toy_mechanism: type[ToyMechanism]) -> None:
    strategy = DPStrategy(noise="toy", target_epsilon=4.0, target_delta=DELTA, seed=0)
    make_trainer(strategy, max_steps=6).fit(TinyRegressor())
    engine = strategy.privacy_engine
    sigma = engine.mechanism.toy_sigma
    assert engine.steps == 6 and (1 - RTOL) * 4.0 <= engine.epsilon() <= 4.0
    assert engine.epsilon() == pytest.approx(zcdp_epsilon([(sigma, 6)], DELTA), rel=1e-12)
    # the generic solver against the closed-form inverse: sqrt(rho) = sqrt(L + eps) - sqrt(L), sigma^2 = T / (2 rho)
    log_inv = math.log(1 / DELTA)
    exact = math.sqrt(6 / (2 * (math.sqrt(log_inv + 4.0) - math.sqrt(log_inv)) ** 2))
    assert exact <= sigma <= exact * (1 + RTOL)
    schedule = dict(target_epsilon=4.0, target_delta=DELTA, sample_rate=engine.sample_rate, steps=6)
    result = calibrate_result("toy", **schedule, max_grad_norm=1.0)
    assert result.accountant == "toy-zcdp" and result.mechanism.toy_sigma == sigma


def test_toy_mechanism_trains_through_dp_trainer(toy_mechanism: type[ToyMechanism], tmp_path) -> None:
    sigma = 2.0
    privacy = PrivacyArguments(noise="toy", noise_params='{"toy_sigma": 2.0}', target_delta=DELTA, dp_seed=0)
    trainer = make_hf_trainer(tiny_gpt2(), tmp_path, privacy=privacy, args=dict(max_steps=3))
    trainer.train()
    engine = trainer.privacy_engine
    assert isinstance(engine.mechanism, ToyMechanism) and engine.accountant.name == "toy-zcdp"
    assert engine.steps == 3 and engine.epsilon() == pytest.approx(zcdp_epsilon([(sigma, 3)], DELTA), rel=1e-12)
    assert trainer.state.log_history[-1]["epsilon"] == pytest.approx(engine.epsilon())
    # calibrated for a target through the HF arguments as well
    privacy = PrivacyArguments(noise="toy", target_epsilon=3.0, target_delta=DELTA, dp_seed=0)
    trainer = make_hf_trainer(tiny_gpt2(), tmp_path, privacy=privacy, args=dict(max_steps=3))
    trainer.train()
    assert (1 - RTOL) * 3.0 <= trainer.privacy_engine.epsilon() <= 3.0


# ============================================================================================ 2. clipping engines


class ToyFlatEngine(ClippingEngine):
    """``flat`` written again: the per-sample gradient summed over the uses, then its norm."""

    name = "toy-flat"
    supports_l1 = True

    def contribution(self, terms: list[Term], norm: int, generator: torch.Generator | None = None) -> torch.Tensor:
        return gradient_contribution(materialise_sum(terms), norm)


class ToyHutchEngine(RandomizedEngine):
    """Hutchinson's estimate ``||M_i P||_F^2`` with ``P`` ``[n, k]`` of ``N(0, 1/k)`` entries (as ``hutch``); the
    ``rc`` accountant bounds it because the engine is ``randomized`` with the Hutchinson ``estimator`` law."""

    name = "toy-hutch"
    estimator = "hutch"

    def estimate(self, operator: GradientOperator, generator: torch.Generator) -> torch.Tensor:
        return operator.times(operator.gaussian(self.projection_dim, generator)).square().sum((1, 2))


@pytest.fixture
def toy_engines() -> Iterator[None]:
    register_engine(ToyFlatEngine)
    register_engine(ToyHutchEngine)
    try:
        yield
    finally:
        ENGINES.remove(ToyFlatEngine.name)
        ENGINES.remove(ToyHutchEngine.name)


def _fit_regressor(**options: object) -> tuple[list[torch.Tensor], DPStrategy]:
    torch.manual_seed(0)
    module = TinyRegressor()
    strategy = DPStrategy(max_grad_norm=0.5, seed=3, **options)
    make_trainer(strategy, max_steps=4).fit(module)
    return [p.detach() for p in module.parameters()], strategy


def test_toy_engine_trains_like_flat_through_dp_strategy(toy_engines: None) -> None:
    toy, strategy = _fit_regressor(clipping="toy-flat", noise_multiplier=1.0)
    flat, reference = _fit_regressor(clipping="flat", noise_multiplier=1.0)
    assert strategy.privacy_engine.summary()["clipping"] == "toy-flat"
    for a, b in zip(toy, flat, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert strategy.privacy_engine.accountant.name == "pld"
    assert strategy.privacy_engine.epsilon() == reference.privacy_engine.epsilon()


def test_toy_randomized_engine_is_accounted_by_rc_through_dp_strategy(toy_engines: None) -> None:
    """The rc accountant is chosen by the ``randomized`` flag: the toy run equals the ``hutch`` run (same
    projection stream) in parameters, accountant, ledger and epsilon."""
    toy, strategy = _fit_regressor(clipping="toy-hutch", noise_multiplier=1.0)
    hutch, reference = _fit_regressor(clipping="hutch", noise_multiplier=1.0)
    for a, b in zip(toy, hutch, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    engine = strategy.privacy_engine
    assert engine.accountant.name == "rc" and engine.accountant.ledger == reference.privacy_engine.accountant.ledger
    assert 0 < engine.epsilon() == reference.privacy_engine.epsilon()
    with pytest.raises(ValueError, match="randomized-clipping accountant"):
        DPStrategy(clipping="toy-hutch", noise_multiplier=1.0, accountant="pld")
    # calibration for a target goes through the rc calibration as well
    _, calibrated = _fit_regressor(clipping="toy-hutch", target_epsilon=3.0, target_delta=DELTA)
    assert calibrated.privacy_engine.accountant.name == "rc"
    assert (1 - RTOL) * 3.0 <= calibrated.privacy_engine.epsilon() <= 3.0


def test_a_randomized_engine_without_an_estimator_law_is_refused() -> None:
    class Unaccountable(RandomizedEngine):
        name = "toy-unaccountable"

        def estimate(self, operator: GradientOperator, generator: torch.Generator) -> torch.Tensor:
            return operator.times(operator.gaussian(self.projection_dim, generator)).square().sum((1, 2)) * 0.5

    with pytest.raises(ValueError, match="must set estimator to one of"):
        register_engine(Unaccountable)
    assert "toy-unaccountable" not in ENGINES


def _train_gpt2(tmp_path, **privacy: object) -> tuple[dict[str, torch.Tensor], object]:
    model = tiny_gpt2()
    trainer = make_hf_trainer(model, tmp_path, privacy=PrivacyArguments(dp_seed=0, **privacy), args=dict(max_steps=2))
    trainer.train()
    return trainable_snapshot(model), trainer.privacy_engine


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_toy_engines_train_through_dp_trainer(toy_engines: None, tmp_path) -> None:
    toy, engine = _train_gpt2(tmp_path, clipping="toy-flat", noise_multiplier=1.0)
    flat, _ = _train_gpt2(tmp_path, clipping="flat", noise_multiplier=1.0)
    assert engine.clipper is None and engine.steps == 2 and engine.accountant.name == "pld"
    for name in flat:
        torch.testing.assert_close(toy[name], flat[name], rtol=1e-5, atol=1e-6, msg=name)
    toy, engine = _train_gpt2(tmp_path, clipping="toy-hutch", noise_multiplier=1.0)
    hutch, reference = _train_gpt2(tmp_path, clipping="hutch", noise_multiplier=1.0)
    assert engine.accountant.name == "rc" and 0 < engine.epsilon() == reference.epsilon()
    for name in hutch:
        torch.testing.assert_close(toy[name], hutch[name], rtol=1e-5, atol=1e-6, msg=name)


# ================================================================================================ 3. a layer family


class Scale(nn.Module):
    """``y = x * weight`` over the last dimension, ``weight`` ``[d]``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def scale_terms(layer: Scale, activation: torch.Tensor, output_grad: torch.Tensor) -> dict[str, Term]:
    """``grad weight_i = sum_t x_it * G_it`` over the dimensions between the sample and the last one."""
    dtype = compute_dtype(layer.weight)
    grad = activation.to(dtype) * output_grad.to(dtype)
    lead = tuple(range(1, grad.ndim - 1))
    return {"weight": Materialised(grad.sum(lead) if lead else grad)}


@pytest.fixture
def scale_layer() -> Iterator[type[Scale]]:
    register_layer(Scale)(scale_terms)
    try:
        yield Scale
    finally:
        _BY_TYPE.remove(Scale)


class ScaledRegressor(TinyRegressor):
    """TinyRegressor with a ``Scale`` between its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), Scale(8), nn.Tanh(), nn.Linear(8, 1))


def scaled_gpt2() -> nn.Module:
    """The tiny GPT-2 with a ``Scale`` after its final layer norm (so on the input of the tied ``lm_head``)."""
    model = tiny_gpt2()
    model.transformer.ln_f = nn.Sequential(model.transformer.ln_f, Scale(model.config.n_embd))
    return model


@pytest.mark.filterwarnings("ignore:There is a performance drop")
@pytest.mark.parametrize("clipping", CLIPPING_ENGINES)
def test_toy_layer_matches_the_oracle(scale_layer: type[Scale], clipping: str) -> None:
    """Per-sample norms and the clipped sum against torch.func, on a sequence input and inside GPT-2."""
    model = randomise(nn.Sequential(nn.Linear(5, 4), Scale(4), nn.Tanh(), Scale(4)))
    check_against_oracle(model, (rand(3, 7, 5),), clipping)
    ids = torch.randint(0, 50, (3, 8), generator=torch.Generator().manual_seed(0))
    check_against_oracle(scaled_gpt2().double().eval(), (ids,), clipping, loss_fn=lm_loss)


def test_toy_layer_trains_through_dp_strategy(scale_layer: type[Scale]) -> None:
    torch.manual_seed(0)
    module = ScaledRegressor()
    before = module.net[1].weight.detach().clone()
    strategy = DPStrategy(noise_multiplier=1.0, max_grad_norm=0.5, clipping="ghost", seed=0)
    make_trainer(strategy, max_steps=3).fit(module)
    assert strategy.privacy_engine.steps == 3 and strategy.privacy_engine.epsilon() > 0
    assert not torch.equal(module.net[1].weight, before)


def test_unregistered_toy_layer_falls_back_to_torch_func(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="lightning_dp"):
        make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=1).fit(ScaledRegressor())
    assert any("fallback" in r.getMessage() and "(Scale," in r.getMessage() for r in caplog.records)


@pytest.mark.filterwarnings("ignore:There is a performance drop")
def test_toy_layer_trains_through_dp_trainer(scale_layer: type[Scale], tmp_path) -> None:
    model = scaled_gpt2()
    before = model.transformer.ln_f[1].weight.detach().clone()
    privacy = PrivacyArguments(noise_multiplier=1.0, clipping="mixed", dp_seed=0)
    trainer = make_hf_trainer(model, tmp_path, privacy=privacy, args=dict(max_steps=2))
    trainer.train()
    assert trainer.privacy_engine.steps == 2 and trainer.privacy_engine.epsilon() > 0
    assert not torch.equal(model.transformer.ln_f[1].weight, before)


def test_the_toys_are_gone_after_their_tests() -> None:
    assert "toy" not in MECHANISMS and "toy-zcdp" not in ACCOUNTANTS and "ToyEvent" not in _EVENT_TYPES
    assert "toy-flat" not in ENGINES and "toy-hutch" not in ENGINES and Scale not in _BY_TYPE
