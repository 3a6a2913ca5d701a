"""The audit on real DPStrategy runs: canaries go through the run's own noise path, and the audit separates a
correct run (lower bound below the reported epsilon) from a broken one (a tenth of the noise the accountant
assumes: lower bound above the reported epsilon), for every noise mechanism, at 95 % confidence."""

import numpy as np
import pytest
import torch
from helpers import TinyRegressor, make_trainer
from torch.utils.data import DataLoader

from lightning_dp import DPStrategy
from lightning_dp.audit import AuditConfig, GradientCanaryAudit, NoiseScaledForTesting, run_audit
from lightning_dp.audit.setups import make_setup
from lightning_dp.mechanisms import make_mechanism


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small models on a shared 2-core machine run far faster on one intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _fit_with_canaries(strategy, num_canaries=400, epochs=3, seed=0):
    setup = make_setup("linear", seed=seed)
    audit = GradientCanaryAudit(num_canaries, seed=seed, coordinates=setup.canary_coordinates)
    make_trainer(strategy, max_epochs=epochs, callbacks=[audit]).fit(
        setup.module, train_dataloaders=DataLoader(setup.train_set, batch_size=100)
    )
    return audit


def test_canaries_enter_the_clipped_sum_before_the_division_by_the_expected_batch_size():
    # Without noise, an OUT canary's coordinate never moves and an IN canary scores C / (q N) per sampled step.
    audit = _fit_with_canaries(DPStrategy(noise_multiplier=0.0, max_grad_norm=2.0, seed=0))
    scores, included = audit.canaries.scores, audit.canaries.included.numpy()
    assert audit.canaries.steps_observed == 30
    assert np.all(scores[~included] == 0.0)
    sampled = scores[included] / (2.0 / 100)
    np.testing.assert_allclose(sampled, np.round(sampled), atol=1e-4)
    assert sampled.mean() == pytest.approx(0.1 * 30, rel=0.15)  # Poisson-sampled at q = 0.1 over 30 steps


@pytest.mark.parametrize("factor", [1.0, 0.1])
def test_canary_coordinates_get_the_configured_mechanisms_noise(factor):
    # OUT scores are sums of 30 privatised noise draws: std = factor * sigma * C * sqrt(T) / (q N).
    strategy = DPStrategy(noise_multiplier=1.5, max_grad_norm=1.0, seed=0)
    setup = make_setup("linear")
    callbacks = [GradientCanaryAudit(1000, seed=0, coordinates=setup.canary_coordinates)]
    if factor < 1:
        from lightning_dp.audit import ScaleNoiseForTesting

        callbacks.insert(0, ScaleNoiseForTesting(factor))
    make_trainer(strategy, max_epochs=3, callbacks=callbacks).fit(
        setup.module, train_dataloaders=DataLoader(setup.train_set, batch_size=100)
    )
    canaries = callbacks[-1].canaries
    out = canaries.scores[~canaries.included.numpy()]
    assert out.std() == pytest.approx(factor * 1.5 * np.sqrt(30) / 100, rel=0.1)
    assert strategy.privacy_engine.mechanism.noise_multiplier == 1.5  # the accountant's view is unchanged
    broken = strategy.privacy_engine.summary().get("BROKEN_FOR_TESTING")
    assert (broken is not None) == (factor < 1)  # a broken run's summary says its epsilon is false


# (noise, target_epsilon, epochs): settings where a tenth of the noise is detectable with 2000 canaries.
MECHANISMS = [
    ("gaussian", 2.0, 10),
    ("lap2", 2.0, 10),
    ("laplace", 1.0, 2),
    ("laplace-advanced", 2.0, 10),
    pytest.param("plrv", 2.0, 10, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("noise", "epsilon", "epochs"), MECHANISMS)
def test_correct_run_audits_below_the_reported_epsilon(noise, epsilon, epochs):
    report = run_audit(AuditConfig(noise=noise, target_epsilon=epsilon, epochs=epochs, num_canaries=2000))
    assert report.steps == 10 * epochs and report.audit.confidence == 0.95
    assert report.audit.epsilon_lower_bound < report.reported_epsilon
    assert not report.violated


@pytest.mark.parametrize(("noise", "epsilon", "epochs"), MECHANISMS)
def test_a_tenth_of_the_noise_audits_above_the_reported_epsilon(noise, epsilon, epochs):
    config = AuditConfig(
        noise=noise, target_epsilon=epsilon, epochs=epochs, num_canaries=2000, noise_factor_for_testing=0.1
    )
    report = run_audit(config)
    assert report.audit.epsilon_lower_bound > report.reported_epsilon
    assert report.violated


def test_input_canaries_audit_below_the_reported_epsilon():
    report = run_audit(AuditConfig(mode="input", target_epsilon=4.0, epochs=5, num_canaries=200))
    assert report.mode == "input" and report.audit.num_canaries == 200
    assert report.audit.epsilon_lower_bound < report.reported_epsilon


def test_noise_scaled_for_testing_keeps_the_accountants_event():
    real = make_mechanism("lap2", noise_scale=2.0, max_grad_norm=1.0)
    broken = NoiseScaledForTesting(real, 0.1)
    assert broken.step_event(0.1, 50) == real.step_event(0.1, 50)
    like = torch.zeros(20000)
    draws = broken.sample(like, torch.Generator().manual_seed(0))
    assert draws.abs().mean().item() == pytest.approx(0.1 * real.expected_abs_noise(), rel=0.05)
    with pytest.raises(ValueError, match="factor"):
        NoiseScaledForTesting(real, 1.0)


def test_audit_errors():
    with pytest.raises(TypeError, match="DPStrategy"):
        make_trainer("auto", max_steps=1, callbacks=[GradientCanaryAudit(5)]).fit(TinyRegressor())
    with pytest.raises(ValueError, match="coordinates"):
        make_trainer(DPStrategy(noise_multiplier=1.0), max_steps=1, callbacks=[GradientCanaryAudit(500)]).fit(
            TinyRegressor()
        )
    with pytest.raises(RuntimeError, match="fit"):
        GradientCanaryAudit(5).report()
    with pytest.raises(ValueError, match="mode"):
        AuditConfig(mode="black-box")
    with pytest.raises(ValueError, match="setup"):
        run_audit(AuditConfig(setup="resnet"))
