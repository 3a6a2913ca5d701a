"""DP-SGD-RC end to end: DPStrategy with hutch/hutchpp clipping records randomized-clipping events and reports the
rc accountant's epsilon; the wrong noise or accountant is refused."""

from __future__ import annotations

import pytest
from helpers import TinyRegressor, make_trainer

from lightning_dp import DPStrategy, PrivacyAccountantCallback
from lightning_dp.accounting import RandomizedClippingGaussianEvent
from lightning_dp.mechanisms import randomized_clipping_epsilon


@pytest.mark.parametrize("clipping", ["hutch", "hutchpp"])
def test_fixed_noise_run_reports_the_rc_epsilon(clipping: str) -> None:
    callback = PrivacyAccountantCallback()
    strategy = DPStrategy(noise_multiplier=2.0, max_grad_norm=1.0, clipping=clipping, projection_dim=16, seed=0)
    make_trainer(strategy, max_epochs=2, callbacks=[callback]).fit(TinyRegressor())
    engine = strategy.privacy_engine
    assert engine.accountant.name == "rc"
    event, steps = engine.accountant.ledger[0]
    assert isinstance(event.event, RandomizedClippingGaussianEvent)
    assert (event.event.projection_dim, event.event.norm_dim, event.event.estimator) == (16, 6, clipping)
    expected = randomized_clipping_epsilon(
        2.0, target_delta=engine.target_delta, sample_rate=engine.sample_rate, steps=steps,
        projection_dim=16, norm_dim=6, estimator=clipping,
    )  # fmt: skip
    assert callback.summary["epsilon"] == pytest.approx(expected, rel=1e-9)
    assert callback.summary["projection_dim"] == 16 and callback.summary["norm_dim"] == 6


def test_calibrated_rc_run_spends_the_target_epsilon() -> None:
    callback = PrivacyAccountantCallback()
    strategy = DPStrategy(target_epsilon=3.0, target_delta=1e-5, clipping="hutchpp", seed=0)
    make_trainer(strategy, max_epochs=2, callbacks=[callback]).fit(TinyRegressor())
    assert callback.summary["epsilon"] == pytest.approx(3.0, rel=0.01)
    assert callback.summary["epsilon"] <= 3.0 + 1e-9


@pytest.mark.parametrize(
    "kwargs",
    [
        {"noise": "lap2", "noise_params": {"noise_scale": 1.0}},
        {"noise_multiplier": 1.0, "accountant": "pld"},
        {"noise_multiplier": 1.0, "accountant": "rdp"},
    ],
)
def test_randomized_clipping_needs_gaussian_noise_and_the_rc_accountant(kwargs: dict) -> None:
    with pytest.raises(ValueError, match="accountant='rc'"):
        DPStrategy(clipping="hutch", **kwargs)


def test_unknown_clipping_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="clipping must be one of"):
        DPStrategy(noise_multiplier=1.0, clipping="ghots")
