"""The strategy of correlated noise is optimised for the training's workload: SGD with heavy-ball momentum ``beta``
(a single ``torch.optim.SGD`` with one momentum, no dampening or Nesterov) gets ``C`` optimised for the momentum
workload, anything else prefix sums; the choice changes the noise's cancellation, never the accounting."""

from __future__ import annotations

import pytest
import torch
from helpers import TinyRegressor, make_trainer

from lightning_dp import DPStrategy
from lightning_dp.accounting.banded_mf import band_and_max_column_norm
from lightning_dp.correlated_noise import optimize_banded, strategy_error
from lightning_dp.correlated_noise.workloads import Workload
from lightning_dp.engine.workload import sgd_momentum

PARAMS = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize(
    "optimizer, beta",
    [
        (torch.optim.SGD(PARAMS, lr=0.1, momentum=0.9), 0.9),
        (torch.optim.SGD(PARAMS, lr=0.1), 0.0),
        (torch.optim.SGD(PARAMS, lr=0.1, momentum=0.9, nesterov=True), 0.0),
        (torch.optim.SGD(PARAMS, lr=0.1, momentum=0.9, dampening=0.1), 0.0),
        (torch.optim.SGD([{"params": PARAMS[:1], "momentum": 0.9}, {"params": PARAMS[1:]}], lr=0.1), 0.0),
        (torch.optim.Adam(PARAMS, lr=0.1), 0.0),
    ],
    ids=["momentum", "plain", "nesterov", "dampening", "two-momenta", "adam"],
)
def test_the_workload_momentum_of_an_optimizer(optimizer, beta):
    assert sgd_momentum([optimizer]) == beta
    assert sgd_momentum([optimizer, optimizer]) == 0.0


class _MomentumRegressor(TinyRegressor):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_sgd_with_momentum_gets_a_strategy_optimised_for_it():
    strategy = DPStrategy(noise_multiplier=1.0, seed=0, noise_correlation="banded", correlation_band=3)
    torch.manual_seed(0)
    make_trainer(strategy, max_steps=12).fit(_MomentumRegressor(batch_size=4))
    engine = strategy.privacy_engine
    plan = engine.state.correlation
    momentum = Workload(12, momentum=0.9)
    assert plan.workload == momentum
    assert plan.strategy == optimize_banded(12, 3, max_participations=1, workload=momentum)
    prefix = optimize_banded(12, 3, max_participations=1)
    assert plan.strategy != prefix

    # the error of the iterates at the same privacy: the noise on C x scales with the largest column norm s
    def error(strategy) -> float:
        return strategy_error(strategy, momentum) * band_and_max_column_norm(strategy, 12)[1] ** 2

    assert error(plan.strategy) < error(prefix)
    assert "optimised for SGD momentum 0.9" in "\n".join(engine.startup_lines())
    plain = DPStrategy(noise_multiplier=1.0, seed=0, noise_correlation="banded", correlation_band=3)
    torch.manual_seed(0)
    make_trainer(plain, max_steps=12).fit(TinyRegressor(batch_size=4))
    assert plain.privacy_engine.state.correlation.strategy == prefix
